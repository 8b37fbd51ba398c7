"""Feature drafts (`eagle:model=DIR`, EAGLE-style): a small block that reads the target's last hidden state (after
its final norm, the row its LM head turned into the newest token) with that token's embedding, and predicts the
target's next hidden state; the target's own LM head, over the draft's vocabulary, turns the prediction into a
guess, whose embedding with the predicted state gives the next guess.

The target's hidden state already carries the context, so the draft is one MLP block without attention and
without a KV cache of its own: nothing to catch up on or roll back, and a step reads ~8.5 MB (its Q8_0 block,
3.5 MB, and 8,192 rows of the target's head) where a 10-layer draft reads ~30 MB. On SmolLM2, attention in the
block kept no more guesses (50.1% against 50.0% of first guesses on held-out answers). `kvserve distill --eagle`
trains one.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from kvserve.engine.sequence import Sequence
from kvserve.errors import KVServeError
from kvserve.kernels import native_module, native_ops
from kvserve.layers.linear import Linear, VocabSubset
from kvserve.layers.norm import RMSNorm
from kvserve.layers.quantized import gather_on_huge_pages
from kvserve.models.base import CausalLM, use_q8_weights
from kvserve.spec_decode import chain
from kvserve.spec_decode.draft import read_draft_vocab, write_draft_vocab
from kvserve.spec_decode.proposer import Proposer, check_ints

CONFIG, WEIGHTS = "eagle.json", "eagle.safetensors"


class FeatureDraft(nn.Module):
    """The target's next hidden state from its current one and the embedding of the token sampled from it."""

    ops = None  # kvserve.kernels for silu_and_mul (its norms are told apart); None: torch's

    def __init__(self, hidden_size: int, intermediate_size: int, rms_norm_eps: float, depth: int = 1):
        """`depth`: how many steps ahead it was trained on its own predictions (its proposer's default k)."""
        super().__init__()
        self.config = {"hidden_size": hidden_size, "intermediate_size": intermediate_size, "rms_norm_eps": rms_norm_eps, "depth": depth}
        self.fc = Linear(2 * hidden_size, hidden_size, bias=False)
        self.norm = RMSNorm(hidden_size, rms_norm_eps)
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.out_norm = RMSNorm(hidden_size, rms_norm_eps)  # the target's features are normed: its head reads them

    def forward(self, embedded: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([embedded, features], dim=-1))
        gate_up = self.gate_up_proj(self.norm(x))
        if self.ops is not None:
            act = self.ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return self.out_norm(x + self.down_proj(act))

    def use_native_kernels(self, int8_activations: bool) -> None:
        """Q8_0 weights, native norms and activation (a draft's speed matters, not its last digit); int8 activations
        as the target's (the block's step: 145 us with fp32 activations, 62 with int8 on a 2-core Zen 5)."""
        use_q8_weights(self)
        self.ops = self.norm.ops = self.out_norm.ops = native_ops()
        for linear in (self.fc, self.gate_up_proj, self.down_proj):
            linear.int8_activations = int8_activations

    def fuse(self, head: VocabSubset, target: CausalLM) -> object | None:
        """The block, `head` and the target's embedding as one native call making all of a step's guesses
        (kernels/decode_layer.cpp: FeatureDraft, called through DraftStep), where all three are packed and the
        embedding is plain rows (Gemma scales its); else None."""
        linears, embed = (self.fc, self.gate_up_proj, self.down_proj, head.head), target.embed_tokens
        if (self.ops is None or type(target).embed is not CausalLM.embed or embed.qweight is None or len(embed.qweight.parts) != 1
                or any(m.qweight is None for m in linears) or len({m.int8_activations for m in linears}) > 1):
            return None
        fc, gate_up, down, head_rows = (m.qweight.kernel_args for m in linears)
        (embed_rows,), (embed_type,) = embed.qweight.kernel_args
        draft = torch.classes.kvserve.FeatureDraft(*fc, self.norm.weight, self.norm.eps, *gate_up, *down, self.out_norm.weight,
                                                   self.out_norm.eps, *head_rows, head.ids, embed_rows, embed_type, self.fc.activations)
        return native_module().DraftStep(draft)

    def save(self, out: Path, vocab: list[int] | None) -> None:
        out.mkdir(parents=True, exist_ok=True)
        save_file({name: t.detach().contiguous() for name, t in self.state_dict().items()}, str(out / WEIGHTS))
        (out / CONFIG).write_text(json.dumps(self.config))
        write_draft_vocab(out, vocab)

    @classmethod
    def load(cls, path: Path) -> FeatureDraft:
        """The draft saved in a directory (read_draft_vocab reads the tokens it may propose)."""
        if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
            raise KVServeError(f"{path} is not a feature draft (it needs {CONFIG} and {WEIGHTS}; make one with kvserve distill --eagle)")
        draft = cls(**_read_config(path / CONFIG))
        try:
            draft.load_state_dict(load_file(str(path / WEIGHTS)))
        except (SafetensorError, RuntimeError) as e:  # a damaged file; weights of another shape than eagle.json says
            raise KVServeError(f"cannot load the feature draft's {path / WEIGHTS}: {e}") from e
        return draft.eval()


def _read_config(file: Path) -> dict:
    """eagle.json's sizes, checked: a damaged or hand-edited one was a JSONDecodeError or a TypeError from torch."""
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise KVServeError(f"cannot read {file}: {e}") from e
    required = {"hidden_size", "intermediate_size", "rms_norm_eps"}
    valid = isinstance(config, dict) and required <= set(config) <= required | {"depth"} and all(
        type(config.get(key, 1)) is int and config.get(key, 1) > 0 for key in ("hidden_size", "intermediate_size", "depth"))
    if not valid or type(config["rms_norm_eps"]) not in (int, float):
        raise KVServeError(f"{file} is not a feature draft's settings: {config!r:.200}")
    return config


class EagleProposer(Proposer):
    shared_gate = True

    def __init__(self, model: str = "", k: int = 0, width: int = 1, lookup: int = 4, vocab: int = 0, min_acceptance: int = 15,
                 window: int = 32, **gate):
        """k = 0: as many guesses in a row as the draft was trained to make on its own predictions (its depth).
        width > 1: a tree, where the first guess has width - 1 other candidates beside it (the draft's next likeliest
        tokens), each verified in the same pass. lookup: see Proposer (rewriting a paragraph, 1.70-1.81x where the
        draft alone made 1.03-1.07x; open generation alike with it or without).
        vocab > 0: only the first `vocab` of the tokens the draft lists (most frequent first), as `draft:vocab`: a
        smaller slice of the head to read (8,192 -> 2,048 rows: its step 0.25-0.31 -> 0.17-0.19 ms, 37.8% -> 36.8% of
        guesses kept on the benchmark's open prompts). The gate's min_acceptance is 15%: at two guesses a step, the
        second nearly free beside the draft's step, 15% of guessed tokens kept about pays for them (see the README)."""
        super().__init__(k or 1, min_acceptance, window, lookup, **gate)
        check_ints(width=width, vocab=vocab)
        if not model or not isinstance(model, str):
            raise KVServeError("the eagle proposer needs model=DIR (made by kvserve distill --eagle)")
        if not 1 <= width <= 8 or vocab < 0:
            raise KVServeError(f"the eagle proposer's width must be 1 to 8 and its vocab >= 0 (0: every token the draft lists), "
                               f"got width={width}, vocab={vocab}")
        self.model, self.k_given, self.width, self.vocab = model, bool(k), width, vocab

    def start(self, engine) -> None:
        draft, vocab = FeatureDraft.load(Path(self.model)), read_draft_vocab(Path(self.model), self.vocab)
        target = engine.runner.model
        if draft.config["hidden_size"] != target.config.hidden_size:
            raise KVServeError(f"the feature draft reads hidden states of {draft.config['hidden_size']} values, the model's "
                               f"have {target.config.hidden_size}: it was made for another model")
        if vocab is not None and max(vocab) >= target.config.vocab_size:
            raise KVServeError(f"the feature draft lists token ids past the model's vocabulary ({target.config.vocab_size})")
        if not self.k_given:
            self.k = self.shared.k = max(1, min(draft.config["depth"], 16))
        ids = torch.tensor(vocab if vocab is not None else range(target.config.vocab_size), dtype=torch.long)
        self.head = VocabSubset(target.lm_head, ids)
        linears = (draft.fc, draft.gate_up_proj, draft.down_proj, self.head.head)
        if engine.runner.native:
            draft.use_native_kernels(int8_activations=engine.config.matmul_dtype != "float32")
            gather_on_huge_pages([m.qweight for m in linears if m.qweight is not None])
        self.draft = draft.to(engine.runner.device, engine.config.torch_dtype)  # the states and embeddings it reads are the model's
        self.embed = target.embed
        self.fused, self.fused_rows = draft.fuse(self.head, target), min(m.kernel_rows for m in linears)
        engine.observe_features(self.observe, self.may_guess_next)

    def observe(self, seqs: list[Sequence], states: torch.Tensor, rows: list[int]) -> None:
        for seq, row in zip(seqs, rows):  # the rows are read when guessing (a row a view: ~15 us each on cold caches)
            if not seq.is_finished:
                self.state(seq).own = (seq.num_tokens, states, row)

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """k greedy steps (at most its limit), then the first step's other candidates, for every sequence whose
        newest token came with its hidden state (not one whose tokens a preemption's recompute or a stop string
        changed since)."""
        ready = [i for i, seq in enumerate(seqs) if self.state(seq).own is not None and self.state(seq).own[0] == seq.num_tokens]
        guesses: list[list[int]] = [[] for _ in seqs]
        if not ready:
            return guesses
        owns = [self.state(seqs[i]).own for i in ready]
        k = max(limits[i] for i in ready)
        made = self.guess([seqs[i].token_ids[-1] for i in ready], [states for _, states, _ in owns], [row for _, _, row in owns], k)
        for i, row in zip(ready, made):
            guesses[i] = row[:limits[i]] + row[k:]
        return guesses

    def parents(self, seq: Sequence, count: int) -> list[int]:
        if self.state(seq).copied:
            return chain(count)
        return chain(count - self.width + 1) + [-1] * (self.width - 1) if count else []

    def guess(self, tokens: list[int], states: list[torch.Tensor], rows: list[int], k: int) -> list[list[int]]:
        """Each sequence's k greedy guesses after its newest token, from the hidden state that gave it (row rows[i] of
        states[i]), then its first guess's width - 1 runners-up, likeliest first."""
        if self.fused is not None and len(tokens) <= self.fused_rows:  # more rows: the modules' GEMM path multiplies them
            made, size = self.fused.propose(tokens, states, rows, k, self.width), k + self.width - 1
            return [made[i:i + size] for i in range(0, len(made), size)]
        return self._guess_modules(torch.tensor(tokens, device=self.head.ids.device),
                                   torch.stack([s[row] for s, row in zip(states, rows)]), k).tolist()

    @torch.inference_mode()
    def _guess_modules(self, tokens: torch.Tensor, features: torch.Tensor, k: int) -> torch.Tensor:
        steps, others = [], []
        for step in range(k):
            features = self.draft(self.embed(tokens), features)
            logits = self.head.head(features)
            tokens = self.head.ids[logits.argmax(-1)]
            steps.append(tokens)
            if step == 0 and self.width > 1:
                others = list(self.head.ids[logits.topk(self.width, -1).indices[:, 1:]].unbind(1))
        return torch.stack(steps + others, 1)

    def forget(self, seq: Sequence) -> None:
        if seq.spec_state is not None:
            seq.spec_state.own = None
