"""One forward pass for a scheduled batch: move the blocks the scheduler listed, flatten the batch's tokens,
point attention at the KV cache, sample."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve import hugepages
from kvserve.attention import ForwardContext, QueryGroup
from kvserve.attention.cpu_native import NativeCPUBackend
from kvserve.attention.sdpa import SDPABackend
from kvserve.config import BF16_PROMPT_ATTENTION_ROWS, EngineConfig
from kvserve.engine.scheduler import ScheduledBatch
from kvserve.engine.sequence import Sequence
from kvserve.errors import KVServeError
from kvserve.kernels import native_ops, triton_ops
from kvserve.kv.cache import KVCache, check_pool_fits, pool_sizes
from kvserve.kv.spec import KVLayout
from kvserve.layers.sampler import SamplerOutput, SamplingBatch, sample, score_prompt
from kvserve.models.base import CausalLM, use_q8_weights
from kvserve.layers.quantized import GGUFTensor, QuantizedWeight, gather_on_huge_pages, load_tensor
from kvserve.models.loader import Checkpoint, load_weights
from kvserve.models.registry import model_class
from kvserve.spec_decode import chain, depths, hidden_keys, path, verify


NO_VOTES = 1 << 30  # a sequence's first voting query when none of its queries votes


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor | None  # None: a step the backend runs whole (`whole`)
    ctx: ForwardContext | None
    # flat index of each token whose logits are sampled (a sequence's last, and its guesses'); None: every token, in order
    logits_index: torch.Tensor | None
    sampling_rows: list[int]  # which of the batch's sequences sample (each has 1 + its guesses rows), in order
    # sequences scoring their prompt: (row in the batch, flat index of each scoring token, the prompt token it predicts)
    prompt_rows: list[tuple[int, torch.Tensor, torch.Tensor]]
    group_rows: list[list[int]]  # the batch rows of each query group
    # a step of plain decodes the backend runs whole (its decode): each row's token and position, the block tables
    whole: tuple[list[int], list[int], np.ndarray] | None = None


@dataclass(slots=True)
class StepOutput:
    seqs: list[Sequence]  # the sequences that sampled
    tokens: list[list[int]]  # each one's new tokens: confirmed guesses, then one sampled token
    rows: list[list[int]]  # each new token's row in sampled.logprobs
    sampled: SamplerOutput | None
    votes: dict[Sequence, torch.Tensor] = field(default_factory=dict)  # a voting KV policy's: [layers, kv heads, keys]
    features: torch.Tensor | None = None  # with keep_features: the step's final hidden states [rows, hidden], and
    feature_rows: list[int] = field(default_factory=list)  # each sequence's row there: the state that gave its last new token


class ModelRunner:
    def __init__(self, checkpoint: Checkpoint, config: EngineConfig, max_model_len: int, layout: KVLayout,
                 num_blocks: int | None = None, model: torch.nn.Module | None = None, q8_weights: bool = False):
        """`num_blocks`: the KV pool's; None: kv_cache_memory's, sized once the weights are loaded (pool_sizes).
        `model`: one already built (a self-speculative draft runs the target's own first layers). `q8_weights`:
        dense linear layers quantized to Q8_0 where the kernels run natively (a draft: its speed matters, not its
        last digit)."""
        self.config, self.device = config, config.torch_device
        self.native = config.native_kernels and self.device.type == "cpu" and config.dtype == "float32" and native_ops()
        self.model = model
        if model is None:
            self.model = build_model(checkpoint, config.torch_dtype, max_model_len, self.device, quantized=bool(self.native))
            if self.native:
                self.model.use_fused_ops(native_ops(), int8_activations=config.matmul_dtype != "float32", bf16_tiles=not config.batch_invariant)
                if q8_weights:
                    use_q8_weights(self.model)
                gather_on_huge_pages(self.model.quantized_weights())
            elif self.device.type == "cuda" and config.native_kernels:
                self.model.use_fused_ops(triton_ops())  # None without Triton: torch's ops
            if config.bf16_matmuls:  # after Q8_0: its layers' many-row steps dequantize tiles to bf16 too
                self.model.use_bf16_matmuls()
            self.model.fuse_decode_layers()
        num_residual = 0
        if num_blocks is None:
            num_blocks, num_residual = pool_sizes(layout, config, max_model_len)
        check_pool_fits(layout, num_blocks, num_residual, self.device)
        self.kv_cache = KVCache(layout, num_blocks, num_residual, config.torch_dtype, self.device)
        hugepages.return_freed_memory()
        self.windows = layout.windows
        bf16_past = BF16_PROMPT_ATTENTION_ROWS if config.bf16_prompt_attention else None
        self.sdpa = SDPABackend(self.kv_cache, bf16_past)
        self.backend, self.graphs = self.sdpa, None
        if self.native:
            self.backend = NativeCPUBackend(self.kv_cache, bf16_past)
            self.backend.stack_layers(self.model)
        elif self.device.type == "cuda":
            self.backend, self.graphs = _cuda_backend(self.model, self.sdpa, config, max_model_len)
            if self.graphs is not None:
                self.graphs.capture()
        if config.batch_invariant and not self.backend.batch_invariant:
            raise KVServeError("batch_invariant needs a GGUF model's layers stacked on the native CPU kernels with int8 "
                               "activations (not matmul_dtype=float32, --no-native-kernels, CUDA or a KV format the decode "
                               "kernel cannot write)")
        self.last_logits: torch.Tensor | None = None  # kept for tests that compare steps

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, keep_features: bool = False) -> StepOutput:
        """Move blocks, then run the batch and sample: a prompt's waiting completions sample from its logits too,
        in the step that finishes it; a sequence with guesses samples at each of them and keeps the guesses its
        samples confirm, plus its next sample. `keep_features`: the output holds the final hidden states too (a
        feature draft reads them)."""
        self.move_blocks(batch)
        if not batch.seqs:
            return StepOutput([], [], [], None)
        inputs = self.prepare(batch, whole=True)
        hidden, selected, logits, argmax = self._run(inputs, any(seq.params.greedy for seq in batch.seqs))
        self.last_logits = logits
        votes = _collect_votes(inputs, batch.seqs, self.kv_cache.layout.num_layers)
        rows, first = [], 0  # (sequence, logits row, its guesses before that row), one per sample
        for row in inputs.sampling_rows:
            seq = batch.seqs[row]
            guesses, parents = seq.draft_token_ids, seq.guess_parents
            rows += [(seq, first, [])] + [(seq, first + 1 + j, [guesses[i] for i in path(parents, j)]) for j in range(len(guesses))]
            rows += [(child, first, []) for child in seq.children]
            first += len(guesses) + 1
        sampling = SamplingBatch([s.params for s, _, _ in rows], [s.generator for s, _, _ in rows], [s.token_ids for s, _, _ in rows],
                                 [s.num_prompt_tokens for s, _, _ in rows], [g for _, _, g in rows], [s.early_stops for s, _, _ in rows])
        index = [i for _, i, _ in rows]
        if index == list(range(logits.shape[0])):  # in order: no copy
            sampled = sample(logits, sampling, argmax)
        else:
            sampled = sample(logits[index], sampling, None if argmax is None else argmax[index])
        output = StepOutput([], [], [], sampled, votes)
        at, moves = 0, []
        while at < len(rows):  # each sequence's samples are consecutive: one after its newest token, then one per guess
            seq = rows[at][0]
            guesses = seq.draft_token_ids
            tokens, kept = verify(guesses, seq.guess_parents, sampled.token_ids[at:at + len(guesses) + 1])
            output.seqs.append(seq)
            output.tokens.append(tokens)
            output.rows.append([at] + [at + 1 + j for j in kept])
            # a kept branch's K/V goes to the slots after the newest token's, where a chain's lies
            moves += [(rows[at + 1 + j][1], rows[at + 1 + i][1]) for i, j in enumerate(kept) if i != j]
            at += len(guesses) + 1
        if moves:
            tokens = inputs.logits_index[torch.tensor(moves, device=inputs.logits_index.device)]
            slots = inputs.ctx.slot_mappings
            self.kv_cache.move([s[tokens[:, 0]] for s in slots], [s[tokens[:, 1]] for s in slots])
        if keep_features:  # rows named, not gathered: indexing by a list took ~90 us a step on the caches a CPU step leaves
            output.features = selected.clone() if self.graphs is not None else selected  # a graph's replay overwrites its output
            output.feature_rows = [rows[sampled_rows[-1]][1] for sampled_rows in output.rows]
        if inputs.prompt_rows:
            prompt_logits = self.model.compute_logits(hidden[torch.cat([index for _, index, _ in inputs.prompt_rows])]).cpu()
            for (row, index, targets), part in zip(inputs.prompt_rows, prompt_logits.split([len(i) for _, i, _ in inputs.prompt_rows])):
                sampled.prompt[batch.seqs[row]] = score_prompt(part, targets, batch.seqs[row].params)
        return output

    def _run(self, inputs: StepInputs, greedy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The step's hidden states, those of its sampling rows, their logits, and each one's argmax where the head's
        kernel found it (`greedy`: asked for; None: not found)."""
        if inputs.whole is not None:
            hidden, logits, argmax = self.backend.decode(*inputs.whole)
            return hidden, hidden, logits, argmax
        if self.graphs is not None and self.graphs.fits(inputs.ctx):
            hidden = self.graphs.run(inputs.input_ids, inputs.ctx)
        else:
            hidden = self.model(inputs.input_ids, inputs.ctx)
        selected = hidden if inputs.logits_index is None else hidden[inputs.logits_index]
        if greedy:
            return hidden, selected, *self.model.compute_logits_argmax(selected)
        return hidden, selected, self.model.compute_logits(selected), None

    def move_blocks(self, batch: ScheduledBatch) -> None:
        for seq, block_ids in batch.swap_out:
            seq.swapped_kv = self.kv_cache.copy_out(block_ids)
        if batch.tier_loads:  # after the swaps out: a block they freed may hold a tier's values now
            self.kv_cache.write_blocks(batch.tier_loads)
        for seq, block_ids in batch.swap_in:
            self.kv_cache.copy_in(block_ids, seq.swapped_kv)
            seq.swapped_kv = None

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy blocks (a forked completion's partly filled last block), (source, copy) pairs."""
        if pairs:
            with torch.inference_mode():
                self.kv_cache.copy_blocks(pairs)

    def compact(self, sources: list[list[int]], dests: list[list[int]], keep: torch.Tensor, reposition: bool) -> None:
        """A KV policy's kept tokens to the front of a sequence's cache (see KVCache.compact); `reposition`: rotate
        moved keys to their new slots."""
        with torch.inference_mode():
            self.kv_cache.compact(sources, dests, keep, self.model.rotary["full_attention"].shift if reposition else None)

    def pack(self, pairs: list[tuple[int, int]]) -> None:
        """kivi2: quantize residual blocks into main blocks, (residual id, main id) pairs."""
        if pairs:
            with torch.inference_mode():
                self.kv_cache.pack(pairs)

    def prepare(self, batch: ScheduledBatch, whole: bool = False) -> StepInputs:
        """The step's inputs: a step of plain decodes takes a short cut to the same ones. `whole`: where the backend
        can run such a step whole (one native call, the embedding to the logits), only its tokens, positions and
        block tables (StepInputs.whole), its guesses' rows too."""
        return self._prepare_decodes(batch, whole) if _plain_decodes(batch) else self._prepare_any(batch)

    def _prepare_any(self, batch: ScheduledBatch) -> StepInputs:
        """The inputs of any step. The index arithmetic runs in NumPy (a decode step's dozens of tiny array ops cost a
        fraction of torch's per-op dispatch) and becomes tensors, without copies, at the end."""
        bs, dev = self.config.block_size, self.device
        starts = np.array([s.num_slots for s in batch.seqs])  # positions in the cache
        real_counts = np.array(batch.num_tokens)
        counts = real_counts + np.array(batch.padding) if batch.padding else real_counts
        offsets = np.cumsum(counts) - counts
        tables = _batch_tables(batch.seqs)
        input_ids = torch.tensor([t for s, n, c in zip(batch.seqs, batch.num_tokens, counts.tolist())
                                  for t in _step_tokens(s, n) + [0] * (c - n)])
        owner = np.repeat(np.arange(len(batch)), counts)
        positions = starts[owner] + np.arange(len(owner)) - offsets[owner]
        slot_mappings = [torch.from_numpy(t[owner, positions // bs] * bs + positions % bs).to(dev) for t in tables]
        policies = [s.policy for s in batch.seqs]
        if any(policies):  # RoPE positions are token positions, but for a policy that places tokens at their slots
            shift = np.array([0 if p is None or p.reposition else s.num_evicted_tokens for s, p in zip(batch.seqs, policies)])
            positions = positions + shift[owner]
        trees = _trees(batch, offsets + real_counts, len(owner))
        if trees is not None:  # a guess's position is its depth under the newest token
            positions = positions - trees[0]
        q_starts, q_counts, q_offsets, q_tables = starts, counts, offsets, tables  # a query row per sequence...
        catch_up = not any(policies)  # (a policy's votes are counted per sequence, not per query)
        prompts_too = self.config.batch_invariant and not batch.rectangular
        per_token = [bool(s.draft_token_ids) or (catch_up and (prompts_too or s.num_computed_tokens >= s.num_prompt_tokens))
                     for s in batch.seqs]
        if any(per_token) and counts.max() > 1:  # ...but the tokens of a guessing sequence, of a draft catching up on
            # its output past the prompt, and, with batch_invariant, of a prompt attend as decodes, each with its own
            # context: the arithmetic of one-token steps, so that a token's numbers never depend on how its sequence
            # was chunked or batched
            q_starts, q_counts, q_offsets, q_tables = _queries_per_token(np.array(per_token), starts, counts, offsets, tables)
        # Decodes; prefills from position 0 (causal); prefill chunks after cached or computed tokens (masked).
        votes = _voters(batch) if any(policies) else None
        one = q_counts == 1
        selections = [one] if one.all() else [rows for rows in (one, ~one & (q_starts == 0), ~one & (q_starts > 0)) if rows.any()]
        if votes is not None:  # voters apart: the others keep the kernels that compute no probabilities (dense fp32
            voting = votes < q_counts  # attention over gathered blocks: 12 requests beside an h2o one ran 12x slower)
            selections = [rows & v for rows in selections for v in (voting, ~voting) if (rows & v).any()]
        hidden = None if trees is None else trees[1][q_offsets]  # per query row
        groups = [_group(rows, q_starts, q_counts, q_offsets, q_tables, bs, self.windows, votes, hidden) for rows in selections]
        groups[0].in_order = len(groups) == 1 and len(owner) == len(groups[0].flat_index)  # no padding, one group
        sampling_rows = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                         if s.num_computed_tokens + n == s.num_tokens + len(s.draft_token_ids)]
        last = (offsets + real_counts - 1).tolist()
        logits_index = torch.tensor([last[i] - len(batch.seqs[i].draft_token_ids) + j for i in sampling_rows
                                     for j in range(len(batch.seqs[i].draft_token_ids) + 1)], dtype=torch.long)
        prompt_rows = [_prompt_row(i, s, n, int(offsets[i])) for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                       if _scores_prompt(s)]
        backend = self.sdpa if batch.rectangular else self.backend
        ctx = ForwardContext(torch.from_numpy(positions).to(dev), slot_mappings, [g.to(dev) for g in groups], backend,
                             {} if votes is not None else None)
        return StepInputs(input_ids.to(dev), ctx, logits_index.to(dev), sampling_rows,
                          [(i, index.to(dev), targets) for i, index, targets in prompt_rows if len(index)],
                          [np.flatnonzero(rows).tolist() for rows in selections])

    def _prepare_decodes(self, batch: ScheduledBatch, whole: bool = False) -> StepInputs:
        """prepare's inputs for a step of plain decodes (_plain_decodes), with a fraction of its array work: a batch-1
        step runs this Python on caches its weights just swept, where each NumPy or torch call costs 10-60 us. Run
        whole, a chain of guesses is rows of their own after their sequence's newest token, at the next positions,
        over the same blocks, as the one-token steps they stand for would compute them (through the layer stack,
        then a head call, a verifying step took ~0.5 ms more at 2-6 rows on a 3 ms step: docs/speculative.md);
        a step with guesses the backend does not run whole goes to _prepare_any."""
        bs, dev, seqs = self.config.block_size, self.device, batch.seqs
        sampling_rows = [i for i, s in enumerate(seqs) if s.num_computed_tokens + 1 == s.num_tokens]
        guesses = [s.draft_token_ids for s in seqs]
        whole = whole and len(sampling_rows) == len(seqs) and sum(batch.num_tokens) <= self.backend.decode_rows
        if any(guesses) and not whole:
            return self._prepare_any(batch)
        tokens, starts = [s.token_ids[s.num_computed_tokens] for s in seqs], [s.num_slots for s in seqs]
        tables = _batch_tables(seqs)
        if whole:  # no torch or NumPy calls beyond the tables
            if any(guesses):
                counts = [1 + len(g) for g in guesses]
                tokens = [t for token, g in zip(tokens, guesses) for t in [token, *g]]
                starts = [start + j for start, n in zip(starts, counts) for j in range(n)]
                tables = np.repeat(tables, counts, axis=1)
            return StepInputs(None, None, None, sampling_rows, [], [sampling_rows], (tokens, starts, tables))
        input_ids, starts = torch.tensor(tokens).to(dev), np.array(starts)  # each token's position and slot in the cache
        rows, ones = np.arange(len(seqs)), np.ones(len(seqs), dtype=np.int64)
        slot_mappings = [torch.from_numpy(t[rows, starts // bs] * bs + starts % bs).to(dev) for t in tables]
        group = _group(ones.astype(bool), starts, ones, rows, tables, bs, self.windows).to(dev)
        group.in_order = True
        logits_index = None if len(sampling_rows) == len(seqs) else torch.tensor(sampling_rows, dtype=torch.long).to(dev)
        ctx = ForwardContext(torch.from_numpy(starts).to(dev), slot_mappings, [group], self.backend)
        return StepInputs(input_ids, ctx, logits_index, sampling_rows, [], [rows.tolist()])


def _plain_decodes(batch: ScheduledBatch) -> bool:
    """Whether every sequence of the step computes one token of its own, in place, and any guesses after it as a
    chain (no tree, KV policy, prompt scoring or padding): a decode step's usual case."""
    return not batch.padding and not batch.rectangular and all(
        s.policy is None and not _scores_prompt(s) and (n == 1 if not s.draft_token_ids else _chain_step(s, n))
        for s, n in zip(batch.seqs, batch.num_tokens))


def _chain_step(seq: Sequence, num_tokens: int) -> bool:
    """Whether a guessing sequence's step is its newest token and a chain of guesses after it."""
    guesses = len(seq.draft_token_ids)
    return num_tokens == 1 + guesses and seq.num_uncomputed_tokens == 1 and seq.guess_parents == chain(guesses)


def _scores_prompt(seq: Sequence) -> bool:
    """Whether the sequence's step scores prompt tokens (prompt_logprobs, while its prompt is being computed)."""
    return seq.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens


def _collect_votes(inputs: StepInputs, seqs: list[Sequence], num_layers: int) -> dict[Sequence, torch.Tensor]:
    """Each voting sequence's votes of this step, [layers, kv heads, keys]."""
    votes, per_layer = {}, inputs.ctx.votes if inputs.ctx is not None else None
    if not per_layer:
        return votes
    for i, (group, rows) in enumerate(zip(inputs.ctx.groups, inputs.group_rows)):
        if group.score_from is None:
            continue
        stacked = torch.stack([per_layer[layer][i] for layer in range(num_layers)], 1).cpu()  # [B, layers, KVH, L]
        for b, row in enumerate(rows):
            if int(group.score_from[b]) != NO_VOTES:
                votes[seqs[row]] = stacked[b]
    return votes


def _batch_tables(seqs: list[Sequence]) -> np.ndarray:
    """The batch's block tables, [groups, batch, blocks], padded with block 0; so are the entries of blocks a
    sliding group gave back (NULL): attention masks them."""
    if len(seqs) == 1:  # no padding to copy into: ~5 us of a batch-1 step's prepare (ad-hoc)
        return np.maximum(seqs[0].block_tables.ids, 0)[:, None]
    tables = np.zeros((len(seqs[0].block_tables.ids), len(seqs), max(len(s.block_tables) for s in seqs)), dtype=np.int64)
    for i, seq in enumerate(seqs):
        tables[:, i, :len(seq.block_tables)] = seq.block_tables.ids
    return np.maximum(tables, 0, out=tables)


def _trees(batch: ScheduledBatch, ends: np.ndarray, num_tokens: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Where a sequence's guesses branch (spec_decode: a proposer's tree), per token of the step: how far its
    position lies before its slot (a guess's position is its depth), and the earlier guesses its attention skips
    (hidden_keys); None where every sequence's guesses are a chain."""
    back = hidden = None
    for seq, end in zip(batch.seqs, ends.tolist()):
        parents = seq.guess_parents
        if parents == chain(len(parents)):
            continue
        if back is None:
            back, hidden = np.zeros(num_tokens, dtype=np.int64), np.zeros(num_tokens, dtype=np.int64)
        back[end - len(parents):end] = np.arange(1, len(parents) + 1) - np.array(depths(parents))
        hidden[end - len(parents):end] = np.array(hidden_keys(parents), dtype=np.uint64).view(np.int64)
    return None if back is None else (back, hidden)


def _queries_per_token(split: np.ndarray, starts, counts, offsets, tables: list[np.ndarray]):
    """Query rows where each `split` sequence's tokens are rows of one token (so the decode kernel serves them,
    with the arithmetic of one-token steps) and other sequences stay one row: starts, counts, offsets, tables."""
    per_row = np.where(split, counts, 1)
    src = np.repeat(np.arange(len(split)), per_row)
    within = np.arange(len(src)) - (np.cumsum(per_row) - per_row)[src]
    return (starts[src] + within, np.where(split[src], 1, counts[src]), offsets[src] + within, [t[src] for t in tables])


def _step_tokens(seq: Sequence, n: int) -> list[int]:
    """The n tokens a sequence computes this step: its uncomputed ones, then its guesses."""
    tokens = seq.token_ids[seq.num_computed_tokens:seq.num_computed_tokens + n]
    return tokens + seq.draft_token_ids[:n - len(tokens)]


def _prompt_row(row: int, seq, num_tokens: int, offset: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Which of this chunk's tokens predict prompt tokens not yet scored (a recomputed prompt is scored once)."""
    start = seq.num_computed_tokens
    targets = torch.arange(max(start + 1, len(seq.prompt_logprobs)), min(start + num_tokens + 1, seq.num_prompt_tokens))
    return row, offset + targets - 1 - start, torch.tensor(seq.token_ids)[targets] if len(targets) else targets


def _voters(batch: ScheduledBatch) -> np.ndarray | None:
    """Each sequence's first query whose attention votes for its cached tokens (a KV policy's); None: no votes."""
    first = []
    for seq, n in zip(batch.seqs, batch.num_tokens):
        at = seq.policy.voters(seq.num_prompt_tokens, seq.num_computed_tokens, n) if seq.policy is not None else None
        first.append(NO_VOTES if at is None else at)
    return np.array(first) if min(first) < NO_VOTES else None


def _group(rows: np.ndarray, starts, counts, offsets, tables: list[np.ndarray], bs: int, windows: list[int | None],
           votes: np.ndarray | None = None, hidden: np.ndarray | None = None) -> QueryGroup:
    """Pad the selected sequences' queries to [B, Q]; their keys are whole blocks, masked past each query. A sliding
    group's keys start at the first block any query's window reaches, masked before each query's window. `hidden`:
    per query row, the keys a decode query skips (bit j: the one j + 1 slots before it; kvserve.kernels' attend),
    where a tree of guesses branches; a window counts the keys it sees."""
    start, count, offset = starts[rows], counts[rows], offsets[rows]
    width = int(count.max())
    if width == 1:  # decodes: a query each, none padding (the same arrays, without the padding arithmetic)
        query_pos, query_index, from_start = start[:, None, None], offset[:, None], False
        valid_at, flat = np.arange(len(start)), offset
    else:
        q = np.arange(width)
        last = np.minimum(q[None, :], count[:, None] - 1)  # padding queries repeat the last real one
        query_pos = (start[:, None] + last)[:, :, None]
        query_index = offset[:, None] + last
        valid = q[None, :] < count[:, None]
        valid_at, flat = np.flatnonzero(valid), query_index[valid]
        from_start = bool((count > 1).all() and (start == 0).all())
    num_blocks = -(-int((start + count).max()) // bs)
    skips = hidden[rows] if hidden is not None and width == 1 and hidden[rows].any() else None
    seen = query_pos  # each query's place among the keys it sees
    if skips is not None:
        seen = query_pos - np.bitwise_count(skips.view(np.uint64)).astype(np.int64)[:, None, None]
    keys = {}  # window -> (first block, mask)
    for window in set(windows):
        first = 0 if window is None else max(0, int(seen[:, 0].min()) - window + 1) // bs
        if from_start and (window is None or width <= window):  # causal from position 0: no mask to build (a
            keys[window] = first, None  # 40,000-token prompt's would take GBs and seconds)
            continue
        key_pos = np.arange(first * bs, num_blocks * bs)[None, None, :]
        allowed = key_pos <= query_pos if window is None else (key_pos <= query_pos) & (key_pos > seen - window)
        if skips is not None:
            back = query_pos - 1 - key_pos
            bit = np.clip(back, 0, 63).astype(np.uint64)
            allowed &= ~((back >= 0) & (back < 64) & ((skips.view(np.uint64)[:, None, None] >> bit) & np.uint64(1)).astype(bool))
        keys[window] = first, None if bool(allowed.all()) else torch.from_numpy(allowed[:, None])
    tensor = torch.from_numpy
    return QueryGroup(tensor(query_index), tensor(valid_at),
                      [tensor(np.ascontiguousarray(t[rows, keys[w][0]:num_blocks])) for t, w in zip(tables, windows)],
                      [keys[w][1] for w in windows], tensor(flat), [tensor(start + count - keys[w][0] * bs) for w in windows],
                      from_start, tensor(votes[rows]) if votes is not None and bool((votes[rows] < count).any()) else None,
                      hidden=None if skips is None else tensor(np.ascontiguousarray(skips)))


def _cuda_backend(model: CausalLM, sdpa: SDPABackend, config: EngineConfig, max_model_len: int):
    """The CUDA backend where the layout is one it attends over in place and Triton is installed (else SDPA), and
    its decode steps' graphs unless enforce_eager."""
    try:
        from kvserve.attention.cuda import CUDABackend
        from kvserve.engine.cuda_graphs import DecodeGraphs
    except ImportError:  # torch's CUDA builds bring Triton on Linux, not everywhere
        return sdpa, None
    if not CUDABackend.supports(sdpa.cache):
        return sdpa, None
    backend = CUDABackend(sdpa.cache)
    if config.enforce_eager:
        return backend, None
    return backend, DecodeGraphs(model, backend, config.max_num_seqs, -(-max_model_len // config.block_size))


def build_model(checkpoint: Checkpoint, dtype: torch.dtype, max_positions: int, device: torch.device,
                quantized: bool = False) -> CausalLM:
    """The model with the checkpoint's weights; `quantized`: a GGUF file's quantized tensors stay packed for
    kvserve.kernels (else they are dequantized)."""
    with torch.device("meta"):
        model = model_class(checkpoint.hf_config)(checkpoint.config, max_positions)
    weights = load_weights(checkpoint)
    for name, w in weights.items():  # one at a time: the file's blocks of a tensor are freed as it is packed
        w = load_tensor(w, quantized) if isinstance(w, GGUFTensor) else w
        weights[name] = w if isinstance(w, QuantizedWeight) else w.to(device=device, dtype=dtype)
    try:
        model.load_hf_weights(weights)
    except (KeyError, RuntimeError) as e:
        raise KVServeError(f"weights in {checkpoint.path} do not match a {checkpoint.hf_config.get('model_type')} model: {e}") from e
    return model.to(device).eval()
