"""One forward pass for a scheduled batch: move the blocks the scheduler listed, flatten the batch's tokens,
point attention at the KV cache, sample."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention import ForwardContext, QueryGroup
from kvserve.attention.cpu_native import NativeCPUBackend
from kvserve.attention.sdpa import SDPABackend
from kvserve.config import EngineConfig
from kvserve.engine.scheduler import ScheduledBatch
from kvserve.engine.sequence import Sequence
from kvserve.errors import KVServeError
from kvserve.kernels import native_ops
from kvserve.kv.cache import KVCache
from kvserve.kv.spec import KVLayout
from kvserve.layers.sampler import SamplerOutput, SamplingBatch, sample, score_prompt
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import Checkpoint, load_gguf_blocks, load_weights


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    ctx: ForwardContext
    logits_index: torch.Tensor  # flat index of the last token of each sequence that samples this step
    sampling_rows: list[int]  # which of the batch's sequences sample, in logits_index order
    # sequences scoring their prompt: (row in the batch, flat index of each scoring token, the prompt token it predicts)
    prompt_rows: list[tuple[int, torch.Tensor, torch.Tensor]]


class ModelRunner:
    def __init__(self, checkpoint: Checkpoint, config: EngineConfig, max_model_len: int, layout: KVLayout, num_blocks: int,
                 num_residual: int = 0):
        self.config, self.device = config, config.torch_device
        self.model = build_model(checkpoint, config.torch_dtype, max_model_len, self.device)
        self.native = config.native_kernels and self.device.type == "cpu" and config.dtype == "float32" and native_ops()
        if self.native:
            self.model.use_native_kernels(load_gguf_blocks(checkpoint))
        if config.bf16_matmuls:
            self.model.use_bf16_matmuls()
        self.kv_cache = KVCache(layout, num_blocks, num_residual, config.torch_dtype, self.device)
        self.sdpa = SDPABackend(self.kv_cache)
        self.backend = NativeCPUBackend(self.kv_cache) if self.native else self.sdpa
        self.last_logits: torch.Tensor | None = None  # kept for tests that compare steps

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], SamplerOutput | None]:
        """Move blocks, then run the batch; returns the sequences that sampled and their tokens (a prompt's
        waiting completions sample from its logits too, in the step that finishes it)."""
        self.move_blocks(batch)
        if not batch.seqs:
            return [], None
        inputs = self.prepare(batch)
        hidden = self.model(inputs.input_ids, inputs.ctx)
        logits = self.model.compute_logits(hidden[inputs.logits_index])
        self.last_logits = logits
        rows = [(seq, i) for i, row in enumerate(inputs.sampling_rows) for seq in [batch.seqs[row], *batch.seqs[row].children]]
        seqs = [seq for seq, _ in rows]
        sampling = SamplingBatch(
            [s.params for s in seqs], [s.generator for s in seqs],
            [s.token_ids[: s.num_prompt_tokens] for s in seqs], [s.output_token_ids for s in seqs],
        )
        sampled = sample(logits.cpu()[[i for _, i in rows]], sampling)
        if inputs.prompt_rows:
            prompt_logits = self.model.compute_logits(hidden[torch.cat([index for _, index, _ in inputs.prompt_rows])]).cpu()
            for (row, index, targets), part in zip(inputs.prompt_rows, prompt_logits.split([len(i) for _, i, _ in inputs.prompt_rows])):
                sampled.prompt[batch.seqs[row]] = score_prompt(part, targets, batch.seqs[row].params)
        return seqs, sampled

    def move_blocks(self, batch: ScheduledBatch) -> None:
        for seq, block_ids in batch.swap_out:
            seq.swapped_kv = self.kv_cache.copy_out(block_ids)
        for seq, block_ids in batch.swap_in:
            self.kv_cache.copy_in(block_ids, seq.swapped_kv)
            seq.swapped_kv = None

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy blocks (a forked completion's partly filled last block), (source, copy) pairs."""
        if pairs:
            with torch.inference_mode():
                self.kv_cache.copy_blocks(pairs)

    def pack(self, pairs: list[tuple[int, int]]) -> None:
        """kivi2: quantize residual blocks into main blocks, (residual id, main id) pairs."""
        if pairs:
            with torch.inference_mode():
                self.kv_cache.pack(pairs)

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        bs, dev = self.config.block_size, self.device
        starts = torch.tensor([s.num_computed_tokens for s in batch.seqs])
        real_counts = torch.tensor(batch.num_tokens)
        counts = real_counts + torch.tensor(batch.padding or [0] * len(batch))
        offsets = torch.cumsum(counts, 0) - counts
        width = max(len(s.block_tables[0]) for s in batch.seqs)
        tables = [torch.tensor([s.block_tables[g] + [0] * (width - len(s.block_tables[g])) for s in batch.seqs])
                  for g in range(len(batch.seqs[0].block_tables))]
        input_ids = torch.tensor([t for s, n, c in zip(batch.seqs, batch.num_tokens, counts.tolist())
                                  for t in s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n] + [0] * (c - n)])
        owner = torch.repeat_interleave(torch.arange(len(batch)), counts)
        positions = starts[owner] + torch.arange(len(owner)) - offsets[owner]
        slot_mappings = [(t[owner, positions // bs] * bs + positions % bs).to(dev) for t in tables]
        # Decodes; prefills from position 0 (causal); prefill chunks after cached or computed tokens (masked).
        groups = [_group(rows, starts, counts, offsets, tables, bs)
                  for rows in (counts == 1, (counts > 1) & (starts == 0), (counts > 1) & (starts > 0)) if rows.any()]
        sampling_rows = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                         if s.num_computed_tokens + n == s.num_tokens]
        logits_index = offsets[sampling_rows] + real_counts[sampling_rows] - 1
        prompt_rows = [_prompt_row(i, s, n, int(offsets[i])) for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                       if s.prompt_logprobs is not None and s.num_computed_tokens < s.num_prompt_tokens]
        backend = self.sdpa if batch.rectangular else self.backend
        ctx = ForwardContext(positions.to(dev), slot_mappings, [g.to(dev) for g in groups], backend)
        return StepInputs(input_ids.to(dev), ctx, logits_index.to(dev), sampling_rows,
                          [(i, index.to(dev), targets) for i, index, targets in prompt_rows if len(index)])


def _prompt_row(row: int, seq, num_tokens: int, offset: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Which of this chunk's tokens predict prompt tokens not yet scored (a recomputed prompt is scored once)."""
    start = seq.num_computed_tokens
    targets = torch.arange(max(start + 1, len(seq.prompt_logprobs)), min(start + num_tokens + 1, seq.num_prompt_tokens))
    return row, offset + targets - 1 - start, torch.tensor(seq.token_ids)[targets] if len(targets) else targets


def _group(rows: torch.Tensor, starts, counts, offsets, tables: list[torch.Tensor], bs: int) -> QueryGroup:
    """Pad the selected sequences' queries to [B, Q]; their keys are whole blocks, masked past each query."""
    start, count, offset = starts[rows], counts[rows], offsets[rows]
    q = torch.arange(int(count.max()))
    last = torch.minimum(q[None, :], count[:, None] - 1)  # padding queries repeat the last real one
    query_pos = start[:, None] + last
    num_blocks = -(-int((start + count).max()) // bs)
    key_pos = torch.arange(num_blocks * bs)
    causal = key_pos[None, None, :] <= query_pos[:, :, None]
    query_index = offset[:, None] + last
    valid = q[None, :] < count[:, None]
    from_start = bool((count > 1).all() and (start == 0).all())
    mask = None if from_start or bool(causal.all()) else causal.unsqueeze(1)
    return QueryGroup(query_index, valid.flatten().nonzero().squeeze(1), [t[rows, :num_blocks] for t in tables], mask,
                      query_index[valid], start + count, from_start)


def build_model(checkpoint: Checkpoint, dtype: torch.dtype, max_positions: int, device: torch.device) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(checkpoint.config, max_positions)
    weights = {k: v.to(device=device, dtype=dtype) for k, v in load_weights(checkpoint).items()}
    try:
        model.load_hf_weights(weights)
    except (KeyError, RuntimeError) as e:
        raise KVServeError(f"weights in {checkpoint.path} do not match a {checkpoint.hf_config.get('model_type')} model: {e}") from e
    return model.to(device).eval()
