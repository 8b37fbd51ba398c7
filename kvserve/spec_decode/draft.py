"""Model drafts: a small model with the target's tokenizer (`draft:model=PATH`), or the target's own first
layers with its final norm and LM head (`self:layers=N`, layer-skip style: no second model, no training).

The draft keeps its own paged KV cache (a KVManager and KVCache of its own, the target's block size and token
capacity) through a shadow of each target sequence. Before proposing, a shadow drops what it computed past
the tokens the target kept and catches up on the rest; then k greedy steps run for every proposing sequence
at once. Greedy guesses are point-mass proposals, so verification stays lossless at any temperature.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.scheduler import ScheduledBatch
from kvserve.engine.sequence import Sequence
from kvserve.errors import KVServeError
from kvserve.kv.manager import KVManager
from kvserve.kv.spec import build_layout
from kvserve.memory import spec_from_hf_config
from kvserve.models.loader import Checkpoint, open_checkpoint
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.proposer import Proposer, check_ints

GREEDY = SamplingParams(temperature=0, max_tokens=1)
DRAFT_VOCAB = "draft_vocab.json"  # {"token_ids": [...]}: the tokens a draft proposes, written by `kvserve distill`


def read_draft_vocab(directory: Path, first: int = 0) -> list[int] | None:
    """The first `first` (0: all) of the tokens a draft's directory lists (most frequent first); None: it lists
    none, so all."""
    listed = directory / DRAFT_VOCAB
    if not listed.is_file():
        return None
    try:
        ids = json.loads(listed.read_text())["token_ids"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise KVServeError(f"cannot read {listed}: {type(e).__name__}: {e}") from e
    if not isinstance(ids, list) or not ids or any(type(t) is not int or t < 0 for t in ids):
        raise KVServeError(f"{listed}: token_ids must be a non-empty list of token ids")
    return ids[:first or len(ids)]


def write_draft_vocab(directory: Path, vocab: list[int] | None) -> None:
    if vocab is not None:
        (directory / DRAFT_VOCAB).write_text(json.dumps({"token_ids": vocab}))


class ModelProposer(Proposer):
    """A draft model with a paged KV cache of its own. Lookups' kept tokens cost the draft a catch-up pass when it
    next guesses; with gates of their own they pay anyway (`self:layers=10` on a 2-core Xeon, lookup 4 against 0:
    rewriting a paragraph 1.60x and 1.45x against 1.01x and 0.96x, open prompts 0.91x and 0.94x against 0.85x and
    1.00x), so `lookup` is 4 by default, as eagle's. While they shared the draft's gates it was 0 (0.90x with
    lookup=4, 0.97x without)."""

    shared_gate = True

    def __init__(self, k: int, min_acceptance: int, window: int, lookup: int, **gate):
        super().__init__(k, min_acceptance, window, lookup, **gate)
        self.runner: ModelRunner | None = None
        self.kv: KVManager | None = None

    def draft(self, engine) -> tuple[Checkpoint, dict, torch.nn.Module | None]:
        """The draft's checkpoint, its HF config (for its KV layout) and, if it is not loaded from the
        checkpoint, its model."""
        raise NotImplementedError

    def vocab_ids(self, checkpoint: Checkpoint) -> list[int] | None:
        """The only tokens the draft may propose (its LM head covers those alone); None: all."""
        return None

    def start(self, engine) -> None:
        checkpoint, hf_config, model = self.draft(engine)
        if checkpoint.config.vocab_size != engine.checkpoint.config.vocab_size:
            raise KVServeError(f"the draft's vocabulary ({checkpoint.config.vocab_size} tokens) is not the target's "
                               f"({engine.checkpoint.config.vocab_size}); a draft needs the target's tokenizer")
        # (the draft only guesses: the target's numbers alone decide the output, batch_invariant or not)
        config = dataclasses.replace(engine.config, model=checkpoint.name, speculative=None, kv_cache_dtype="auto",
                                     cache_type_k=None, cache_type_v=None, enable_prefix_caching=False, batch_invariant=False)
        layout = build_layout(spec_from_hf_config(hf_config, checkpoint.name), *config.kv_dtypes, config.block_size)
        num_blocks = engine.kv_manager.num_blocks // len(engine.layout.groups) * len(layout.groups)  # the target's tokens
        self.runner = ModelRunner(checkpoint, config, engine.max_model_len, layout, num_blocks, model=model, q8_weights=True)
        vocab = self.vocab_ids(checkpoint)
        if vocab is not None:
            self.runner.model.restrict_vocab(torch.tensor(vocab, dtype=torch.long))
        self.kv = KVManager(layout, num_blocks, 0, enable_prefix_caching=False, salt="draft")

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        guesses: dict[Sequence, list[int]] = {}
        shadows = {self._sync(seq): (seq, limit) for seq, limit in zip(seqs, limits)}
        for _ in range(max(limits, default=0)):
            batch = ScheduledBatch()
            for shadow, (seq, want) in shadows.items():
                if len(guesses.get(seq, ())) < want and self.kv.allocate_slots(shadow, shadow.num_uncomputed_tokens):
                    batch.add(shadow, shadow.num_uncomputed_tokens)
            if not batch.seqs:
                break
            step = self.runner.execute(batch)
            for shadow, n in zip(batch.seqs, batch.num_tokens):
                shadow.num_computed_tokens += n
            for shadow, tokens in zip(step.seqs, step.tokens):
                shadow.token_ids.append(tokens[0])
                guesses.setdefault(shadows[shadow][0], []).append(tokens[0])
        return [guesses.get(seq, []) for seq in seqs]

    def _sync(self, seq: Sequence) -> Sequence:
        """The sequence's shadow, holding its tokens, with K/V kept for the longest prefix both still share."""
        state = self.state(seq)
        shadow = state.own
        if shadow is None:
            shadow = state.own = Sequence(seq.request_id, None, seq.token_ids[:seq.num_prompt_tokens], GREEDY,
                                          len(self.kv.layout.groups))
        mine, theirs = shadow.token_ids, seq.token_ids
        same = min(shadow.num_computed_tokens, len(theirs) - 1)  # the last token goes through the draft again, for its logits
        while same > 0 and mine[same - 1] != theirs[same - 1]:
            same -= 1  # only guesses the target rejected differ: a few steps back at most
        mine[same:] = theirs[same:]  # the tokens before `same` are equal already
        if same < shadow.num_computed_tokens:
            shadow.num_computed_tokens = same
            self.kv.truncate(shadow)
        return shadow

    def forget(self, seq: Sequence) -> None:
        if seq.spec_state is not None and seq.spec_state.own is not None:
            self.kv.free(seq.spec_state.own)
            seq.spec_state.own = None


class DraftProposer(ModelProposer):
    def __init__(self, model: str = "", k: int = 4, vocab: int = 0, lookup: int = 4, min_acceptance: int = 50, window: int = 16, **gate):
        super().__init__(k, min_acceptance, window, lookup, **gate)
        if not model or not isinstance(model, str):
            raise KVServeError("the draft proposer needs model=PATH (a Hugging Face directory or .gguf file)")
        check_ints(vocab=vocab)
        if vocab < 0:
            raise KVServeError(f"draft:vocab must be >= 0 (0: every token the draft lists), got {vocab}")
        self.model, self.vocab = model, vocab

    def draft(self, engine) -> tuple[Checkpoint, dict, None]:
        checkpoint = open_checkpoint(self.model)
        return checkpoint, checkpoint.hf_config, None

    def vocab_ids(self, checkpoint: Checkpoint) -> list[int] | None:
        """The first `vocab` (0: all) of the tokens the draft's directory lists (DRAFT_VOCAB, most frequent first)."""
        return read_draft_vocab(Path(checkpoint.path), self.vocab)


class SelfProposer(ModelProposer):
    def __init__(self, layers: int = 0, k: int = 3, lookup: int = 4, min_acceptance: int = 50, window: int = 16, **gate):
        super().__init__(k, min_acceptance, window, lookup, **gate)
        check_ints(layers=layers)
        self.layers = layers

    def draft(self, engine) -> tuple[Checkpoint, dict, torch.nn.Module]:
        total = engine.checkpoint.config.num_layers
        if not 1 <= self.layers < total:
            raise KVServeError(f"self:layers must be in 1..{total - 1} for this model, got {self.layers}")
        hf_config = {**engine.checkpoint.hf_config, "num_hidden_layers": self.layers}
        hf_config.pop("layer_types", None)
        return engine.checkpoint, hf_config, FirstLayers(engine.runner.model, self.layers)


class FirstLayers(torch.nn.Module):
    """The target's first layers, final norm and LM head, sharing its weights."""

    def __init__(self, model: torch.nn.Module, num_layers: int):
        super().__init__()
        self.target, self.num_layers = model, num_layers

    @property
    def layers(self) -> torch.nn.ModuleList:
        return self.target.layers[:self.num_layers]

    @property
    def rotary(self) -> dict:
        return self.target.rotary

    @property
    def norm(self) -> torch.nn.Module:
        return self.target.norm

    def forward(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        return self.target(input_ids, ctx, self.num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)

    def decode_ends(self) -> tuple[tuple, int] | None:
        return self.target.decode_ends()

    def compute_logits_argmax(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.target.compute_logits_argmax(hidden)
