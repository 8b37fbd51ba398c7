"""`kvserve distill`: a draft model made from the target by pruning and distillation, on CPU in minutes.

Pruning keeps the target's first decoder layers and its last third of `layers` (deep middle layers change the
residual stream least; SmolLM2 pruned to 10 layers starts at KL 8.7 from the target keeping the first 7 and last
3, 15.9 keeping the first 9 and last 1, 17.3 keeping the first 10), with its embeddings, final norm and LM head;
`mlp` also narrows each kept MLP to its most active neurons. Distillation then trains the kept layers and norms
(the embedding, tied to the head, stays frozen) to match the target's next-token distributions over the
draft's vocabulary, softened by a temperature, with Hinton's KL loss. The teacher is kvserve itself: the target
scores each batch's windows through its paged cache (SamplingParams(prompt_distributions=True)). The student is
a transformers Llama (training is not what kvserve is for), under bf16 autocast where the CPU multiplies bf16
natively, saved as a Hugging Face directory that LLM(...) and `--speculative draft:model=DIR` load.

The text is Python's documentation, a user's file, or (`answers`) the target's own greedy answers to chat
prompts, built-in ones or (`prompts="self"`) user messages the target writes itself: on-policy data, the text the
draft will be asked to predict when serving chat. The draft also
lists the `vocab` tokens its LM head keeps (draft_vocab.json): a head over 8,192 of SmolLM2's 49,152 tokens
reads a sixth of its bytes (the full head is 30 MB of a 10-layer Q8_0 draft's 68).

With `eagle`, no layers are pruned: a feature draft (spec_decode/eagle.py) learns to predict the target's next
hidden state from its current one and the token sampled from it. On `answers` it learns from the states kvserve
generated each answer token from, recorded as it answered (the very states it reads when serving, kernels'
rounding included, and no second pass over the text); on other text, from the reference model's states.
"""
from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvserve.entrypoints.llm import LLM
from kvserve.errors import KVServeError, check_output_dir
from kvserve.kv.cache import free_memory
from kvserve.models.loader import transformers_model
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.draft import write_draft_vocab
from kvserve.spec_decode.eagle import FeatureDraft

TEACHER = SamplingParams(max_tokens=0, prompt_logprobs=0, prompt_distributions=True)


@dataclass(slots=True)
class DistillSettings:
    model: str = "smollm2-135m"
    out: str = "draft"
    layers: int = 10  # decoder layers kept: the first ones and the last layers // 3 (at least 1)
    mlp: int = 0  # > 0: each kept MLP narrowed to this many intermediate neurons, the most active ones
    steps: int = 60
    batch: int = 4  # windows per step
    seq_len: int = 128  # tokens per window
    lr: float = 5e-4
    temperature: float = 2.0
    text: str | None = None  # a file; None: Python's own documentation (unless `answers`)
    answers: int = 0  # > 0: the text is the target's own answers to this many chat prompts (greedy, then sampled rounds)
    prompts: str = "builtin"  # the chat prompts `answers` asks: "builtin" (TOPICS x TASKS) or "self" (the model writes them)
    vocab: int = 8192  # tokens the draft's LM head covers (the text's most frequent, then the lowest ids); 0: all
    eval_windows: int = 8  # held-out windows (the text's start) for perplexity and KL
    acceptance_prompts: int = 4  # held-out prompts for the draft's acceptance rate
    eagle: bool = False  # a feature draft (spec_decode/eagle.py) instead of pruned layers; `mlp` is its MLP width
    depth: int = 2  # a feature draft trains on its own predictions this many steps ahead (feature_loss), and guesses as many
    seed: int = 0


@dataclass(slots=True)
class Text:
    """Token ids to train on; for a feature draft on answers, also the hidden state at each position and where
    each answer's stretch of positions begins (a state there does not follow the one before)."""
    ids: list[int]
    states: torch.Tensor | None = None  # [len(ids), hidden]
    starts: torch.Tensor | None = None  # [len(ids)] bool


def distill(settings: DistillSettings, token_ids: list[int] | None = None, progress: bool = True) -> dict:
    """Prune and distill (or with `eagle`, train a feature draft) and save; returns the report (losses,
    perplexity and KL before and after, acceptance)."""
    for name, low in (("answers", 0), ("vocab", 0), ("mlp", 0), ("steps", 1), ("batch", 1), ("seq_len", 2)):
        if getattr(settings, name) < low:
            raise KVServeError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(settings, name)}")
    for name in ("lr", "temperature"):
        if not 0 < getattr(settings, name) < math.inf:
            raise KVServeError(f"--{name} must be > 0, got {getattr(settings, name)}")
    if not 1 <= settings.depth <= 8:
        raise KVServeError(f"--depth must be 1..8, got {settings.depth}")
    if settings.answers and settings.text:
        raise KVServeError("distill on --text or on the model's --answers, not both")
    if settings.prompts not in PROMPT_SOURCES:
        raise KVServeError(f"--prompts must be one of {', '.join(PROMPT_SOURCES)}, got {settings.prompts!r}")
    out = Path(settings.out)
    check_output_dir(out, "--out")
    torch.manual_seed(settings.seed)
    teacher = LLM(settings.model, max_num_batched_tokens=max(512, settings.batch * settings.seq_len))
    width, vocab_size = teacher.engine.checkpoint.config.intermediate_size, teacher.engine.checkpoint.config.vocab_size
    need = settings.batch * settings.seq_len * min(settings.vocab or vocab_size, vocab_size) * 2  # a step's fp16 distributions, at least
    if need > (free := free_memory(teacher.engine.config.torch_device)):  # before, such a step ran until memory ran out
        raise KVServeError(f"--batch {settings.batch} x --seq-len {settings.seq_len} needs at least {need / 2**30:.1f} GiB a step "
                           f"for the teacher's distributions, but {free / 2**30:.1f} GiB is free: lower --batch or --seq-len")
    if settings.mlp >= width and not settings.eagle:
        raise KVServeError(f"--mlp must be below the model's MLP width ({width}), got {settings.mlp}")
    text = Text(token_ids) if token_ids is not None else _text(teacher, settings, progress)
    ids = text.ids
    held_out = settings.eval_windows * settings.seq_len
    if len(ids) < held_out + 2 * settings.seq_len:
        raise KVServeError(f"the text has {len(ids)} tokens; distillation needs at least {held_out + 2 * settings.seq_len}")
    evaluation = [ids[i:i + settings.seq_len] for i in range(0, held_out, settings.seq_len)]
    train = ids[held_out:]
    vocab = draft_vocab(train, vocab_size, settings.vocab)
    if settings.eagle:
        report = _distill_features(settings, teacher, text, vocab, progress)
        proposer = "eagle"
    else:
        report = _distill_layers(settings, teacher, evaluation, train, vocab, progress)
        proposer = "draft"
    report["acceptance"] = acceptance(settings.model, f"{proposer}:model={out}", evaluation[:settings.acceptance_prompts])
    plot_losses(report["losses"], out / "loss.png")
    return {"settings": asdict(settings), **report}


def _distill_layers(settings: DistillSettings, teacher: LLM, evaluation: list[list[int]], train: list[int],
                    vocab: list[int] | None, progress: bool) -> dict:
    """A pruned copy of the target trained to its next-token distributions, saved as a Hugging Face directory."""
    student = prune(teacher, settings.layers)
    if settings.mlp:
        narrow_mlp(student, settings.mlp, [train[i:i + settings.seq_len] for i in range(0, 16 * settings.seq_len, settings.seq_len)])
    head_ids = torch.tensor(vocab) if vocab is not None else None
    bf16 = teacher.engine.config.bf16_matmuls  # the student trains in the precision the CPU multiplies fastest
    before = evaluate(student, teacher, evaluation)
    rng = random.Random(settings.seed)

    def loss() -> torch.Tensor:
        windows = [train[s:s + settings.seq_len] for s in (rng.randrange(len(train) - settings.seq_len) for _ in range(settings.batch))]
        target = _teacher_logprobs(teacher, windows)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return kl_loss(student, target, windows, settings.temperature, head_ids)

    losses = train_steps([p for p in student.parameters() if p.requires_grad], loss, settings, progress)
    after = evaluate(student, teacher, evaluation)
    save(student, teacher, Path(settings.out), vocab)
    return {"kept_layers": kept_layers(teacher, settings.layers), "losses": losses,
            "target_perplexity": before["target_perplexity"], "before": before["student"], "after": after["student"]}


def _distill_features(settings: DistillSettings, teacher: LLM, text: Text, vocab: list[int] | None, progress: bool) -> dict:
    """A feature draft (spec_decode/eagle.py) trained on the target's hidden states: the text's own (answers), else
    computed once for its windows by the reference model (transformers). Its MLP is `mlp` wide (0: the target's MLP
    width). The first `eval_windows` windows are held out. It trains where the target runs (a GPU's minutes are a
    CPU's hours)."""
    config, length, held = teacher.engine.checkpoint.config, settings.seq_len, settings.eval_windows
    device = teacher.engine.runner.device
    reference = transformers_model(teacher.engine.checkpoint.path).eval()
    bf16 = teacher.engine.config.bf16_matmuls
    draft = FeatureDraft(config.hidden_size, settings.mlp or config.intermediate_size, config.rms_norm_eps, settings.depth).to(device)
    count = len(text.ids) // length * length
    windows = torch.tensor(text.ids[:count]).view(-1, length)
    features = (text.states[:count].view(len(windows), length, -1) if text.states is not None
                else _hidden_states(reference, windows, bf16))
    follows = (~text.starts[:count].view(len(windows), length)[:, 1:] if text.starts is not None
               else torch.ones(len(windows), length - 1, dtype=torch.bool))  # a pair of positions the loss may join
    windows, features, follows = windows.to(device), features.to(device), follows.to(device)
    embed = reference.get_input_embeddings().to(device)
    head = reference.get_output_embeddings().weight.detach().to(device)
    ids = (torch.tensor(vocab) if vocab is not None else torch.arange(config.vocab_size)).to(device)
    vocab_head = head[ids]  # the rows the training loss reads, copied once
    held_out = (windows[:held], features[:held], follows[:held])
    windows, features, follows = windows[held:], features[held:], follows[held:]
    before = evaluate_features(draft, embed, head, ids, *held_out)
    generator = torch.Generator(device).manual_seed(settings.seed)

    def loss() -> torch.Tensor:
        pick = torch.randint(len(windows), (settings.batch,), generator=generator, device=device)
        with torch.no_grad():
            embedded = embed(windows[pick])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            return feature_loss(draft, embedded, features[pick], vocab_head, generator, follows=follows[pick], depth=settings.depth)

    losses = train_steps(list(draft.parameters()), loss, settings, progress)
    after = evaluate_features(draft, embed, head, ids, *held_out)
    draft.cpu().save(Path(settings.out), vocab)
    after.pop("target_perplexity")
    return {"losses": losses, "target_perplexity": before.pop("target_perplexity"), "before": before, "after": after}


def feature_loss(draft: FeatureDraft, embedded: torch.Tensor, features: torch.Tensor, head: torch.Tensor,
                 generator: torch.Generator | None = None, noise: float = 0.05, follows: torch.Tensor | None = None,
                 depth: int = 1) -> torch.Tensor:
    """EAGLE's loss on windows [B, T]: from the hidden state at t (with noise, as the draft's own predictions will
    be) and the embedding of token t + 1, the state at t + 1: smooth L1 to it, plus 0.3 x the cross-entropy of the
    tokens the head gives it (the target's distribution) under the head applied to the prediction; averaged over
    the pairs (t, t + 1) that `follows` [B, T - 1] marks (default: all). With depth d > 1, the draft then goes on
    from its own prediction, as it does when it guesses d tokens (EAGLE-3's training-time test): the prediction
    and token t + 2 give the state at t + 2, and so on; the loss is the mean over the d depths."""
    follows = torch.ones(features.shape[:1] + (features.shape[1] - 1,), dtype=torch.bool, device=features.device) if follows is None else follows
    current = features[:, :-1] + noise * torch.randn(features[:, :-1].shape, generator=generator, device=features.device)
    valid, losses = follows, []
    for d in range(min(depth, features.shape[1] - 1)):
        predicted, following = draft(embedded[:, 1 + d:], current), features[:, 1 + d:]
        target = F.softmax(following @ head.T, dim=-1)
        cross_entropy = -(target * F.log_softmax((predicted @ head.T).float(), dim=-1)).sum(-1)
        per_pair = F.smooth_l1_loss(predicted.float(), following, reduction="none").mean(-1) + 0.3 * cross_entropy
        losses.append(_masked_mean(per_pair, valid))
        current, valid = predicted[:, :-1], valid[:, :-1] & follows[:, 1 + d:]
    return torch.stack(losses).mean()


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


@torch.no_grad()
def evaluate_features(draft: FeatureDraft, embed, head: torch.Tensor, vocab: torch.Tensor, ids: torch.Tensor,
                      features: torch.Tensor, follows: torch.Tensor) -> dict:
    """On windows [B, T] with the target's hidden states, over the pairs of positions `follows` [B, T - 1] joins:
    the draft's perplexity of each token two ahead of a state and its KL from the target's distribution there
    (full vocabulary), the share of its guesses (over `vocab`) that are the target's greedy token, the share of
    its second guesses (from its own first prediction) that are, where the first one was, and the target's
    perplexity of the next token."""
    embedded = embed(ids)
    predicted = draft(embedded[:, 1:], features[:, :-1])
    logp, target = F.log_softmax(predicted @ head.T, dim=-1), F.log_softmax(features @ head.T, dim=-1)
    kl = (target[:, 1:].exp() * (target[:, 1:] - logp)).sum(-1)
    greedy, vocab_head = target.argmax(-1), head[vocab]
    guess = lambda states: vocab[(states @ vocab_head.T).argmax(-1)]  # noqa: E731
    hits = guess(predicted) == greedy[:, 1:]
    second = guess(draft(embedded[:, 2:], predicted[:, :-1])) == greedy[:, 2:]
    chained = follows[:, :-1] & follows[:, 1:] & hits[:, :-1] & (ids[:, 2:] == greedy[:, 1:-1])  # the first guess was the token given
    two_ahead = logp[:, :-1].gather(-1, ids[:, 2:, None])[..., 0]
    return {"perplexity": math.exp(-float(_masked_mean(two_ahead, follows[:, :-1] & follows[:, 1:]))),
            "kl_mean": float(_masked_mean(kl, follows)),
            "agreement": float(_masked_mean(hits.float(), follows)),
            "second_agreement": float(_masked_mean(second.float(), chained)),
            "target_perplexity": math.exp(-float(_masked_mean(target[:, :-1].gather(-1, ids[:, 1:, None])[..., 0], follows)))}


@torch.no_grad()
def _hidden_states(reference, windows: torch.Tensor, bf16: bool, batch: int = 8) -> torch.Tensor:
    """[windows, tokens, hidden]: the reference model's last hidden states (after its final norm), as fp32."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return torch.cat([reference.model(part).last_hidden_state.float() for part in windows.split(batch)])


def train_steps(params: list[torch.Tensor], loss_fn, settings: DistillSettings, progress: bool) -> list[float]:
    """AdamW over `settings.steps` steps of loss_fn() (warm-up, then a cosine schedule), gradients clipped at 1;
    the losses, with a progress bar."""
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5) * 0.5 * (1 + math.cos(math.pi * s / settings.steps)))
    losses = []
    with tqdm(range(settings.steps), desc="distill", unit="step", disable=not progress) as bar:
        for step in bar:
            loss = loss_fn()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            bar.set_postfix_str(f"loss {losses[-1]:.3f}")
            if not math.isfinite(losses[-1]):  # a diverged draft was saved, and its acceptance measured, as any other
                raise KVServeError(f"the loss became {losses[-1]} at step {step + 1}: training diverged (lower --lr, now {settings.lr})")
    if not all(bool(torch.isfinite(p).all()) for p in params):
        raise KVServeError(f"the draft's weights are no longer finite: training diverged (lower --lr, now {settings.lr})")
    return losses


def prune(teacher: LLM, layers: int):
    """The target as a transformers Llama with `layers` of its decoder layers (kept_layers)."""
    checkpoint = teacher.engine.checkpoint
    total = checkpoint.config.num_layers
    if not 1 <= layers < total:
        raise KVServeError(f"--layers must be in 1..{total - 1} for {checkpoint.name}, got {layers}")
    model = transformers_model(checkpoint.path)
    if getattr(model, "hf_quantizer", None) is not None:  # a GGUF file, dequantized to plain tensors, yet marked
        model.hf_quantizer = None  # quantized, which bars save_pretrained; the draft is saved as plain weights
        model.config.__dict__.pop("quantization_config", None)
    keep = kept_layers(teacher, layers)
    model.model.layers = torch.nn.ModuleList(model.model.layers[i] for i in keep)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = i
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]
    model.get_input_embeddings().weight.requires_grad_(False)  # tied to the LM head in SmolLM2: stays the target's
    model.get_output_embeddings().weight.requires_grad_(False)
    return model


@torch.no_grad()
def narrow_mlp(student, width: int, windows: list[list[int]]) -> None:
    """Each layer's MLP keeps the `width` intermediate neurons of the largest mean |activation| on the windows
    (activation importance, as Minitron's width pruning): gate and up keep those rows, down those columns."""
    full = student.config.intermediate_size
    if not 0 < width < full:
        raise KVServeError(f"--mlp must be below the model's MLP width ({full}), got {width}")
    layers = student.model.layers
    importance = torch.zeros(len(layers), full)

    def hook(i: int):
        def add(_, args) -> None:  # a pre-hook that returned the sum would replace the layer's input
            importance[i] += args[0].abs().flatten(0, -2).sum(0)
        return add

    hooks = [layer.mlp.down_proj.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    for window in windows:
        student(torch.tensor([window]))
    for handle in hooks:
        handle.remove()
    for layer, score in zip(layers, importance):
        keep, mlp = score.topk(width).indices.sort().values, layer.mlp
        mlp.gate_proj, mlp.up_proj = _narrowed(mlp.gate_proj, keep, 0), _narrowed(mlp.up_proj, keep, 0)
        mlp.down_proj = _narrowed(mlp.down_proj, keep, 1)
    student.config.intermediate_size = width


def _narrowed(linear: torch.nn.Linear, keep: torch.Tensor, dim: int) -> torch.nn.Linear:
    """The linear layer with only the `keep` outputs (dim 0) or inputs (dim 1)."""
    weight = linear.weight.index_select(dim, keep)
    out = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=linear.bias is not None)
    out.weight.copy_(weight)
    if linear.bias is not None:
        out.bias.copy_(linear.bias if dim else linear.bias[keep])
    return out


def kept_layers(teacher: LLM, layers: int) -> list[int]:
    """The first layers and the last layers // 3 (at least 1)."""
    total, last = teacher.engine.checkpoint.config.num_layers, max(1, layers // 3)
    return list(range(layers - last)) + list(range(total - last, total))


def kl_loss(student, teacher_logprobs: torch.Tensor, windows: list[list[int]], temperature: float,
            vocab: torch.Tensor | None = None) -> torch.Tensor:
    """KL(teacher || student) of the temperature-softened next-token distributions, times T^2 (Hinton). With
    `vocab`, both distributions are over those token ids only, the ones the draft can propose: the head's
    matmul and softmax shrink with it (8,192 of SmolLM2's 49,152 tokens: a 10-layer step 1.44 s instead of 1.92)."""
    hidden = student.model(torch.tensor(windows)).last_hidden_state[:, :-1]
    head = student.get_output_embeddings().weight
    if vocab is not None:
        head, teacher_logprobs = head[vocab], teacher_logprobs[..., vocab]
    logits = F.linear(hidden, head).float()
    soft_teacher = F.log_softmax(teacher_logprobs / temperature, dim=-1)
    soft_student = F.log_softmax(logits / temperature, dim=-1)
    kl = F.kl_div(soft_student.flatten(0, 1), soft_teacher.flatten(0, 1), log_target=True, reduction="batchmean")
    return kl * temperature**2


@torch.no_grad()
def evaluate(student, teacher: LLM, windows: list[list[int]]) -> dict:
    """The student's perplexity on the windows and its mean KL from the target; the target's perplexity."""
    nll = kl = target_nll = 0.0
    count = 0
    for window in windows:
        target = _teacher_logprobs(teacher, [window])[0]
        logp = F.log_softmax(student(torch.tensor([window])).logits[0, :-1].float(), dim=-1)
        next_ids = torch.tensor(window[1:])[:, None]
        nll -= float(logp.gather(1, next_ids).sum())
        target_nll -= float(target.gather(1, next_ids).sum())
        kl += float((target.exp() * (target - logp)).sum())
        count += len(window) - 1
    return {"student": {"perplexity": math.exp(nll / count), "kl_mean": kl / count},
            "target_perplexity": math.exp(target_nll / count)}


def acceptance(model: str, speculative: str, windows: list[list[int]]) -> dict:
    """Greedy speculative decoding with the saved draft on held-out prompts: the share of guesses kept."""
    llm = LLM(model, speculative=f"{speculative},k=4,min_acceptance=0,min_speedup=0")
    outs = llm.generate([w[: len(w) // 2] for w in windows], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                        use_tqdm=False)
    proposed = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    return {"draft_tokens": proposed, "accepted_tokens": accepted, "rate": accepted / proposed if proposed else 0.0}


def draft_vocab(ids: list[int], vocab_size: int, size: int) -> list[int] | None:
    """The `size` tokens the draft proposes (FR-Spec): the text's by frequency, then the lowest ids (a BPE
    vocabulary's earliest merges, its most frequent pieces); None: all of them."""
    if not 0 < size < vocab_size:
        return None
    chosen = dict.fromkeys(token for token, _ in Counter(ids).most_common(size))
    chosen.update(dict.fromkeys(itertools.islice((i for i in range(vocab_size) if i not in chosen), size - len(chosen))))
    return list(chosen)


def save(student, teacher: LLM, out: Path, vocab: list[int] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    student.save_pretrained(out)
    write_draft_vocab(out, vocab)
    tokenizer = teacher.engine.checkpoint.tokenizer
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def plot_losses(losses: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("KL to the target (x T^2)")
    ax.set_title("distillation loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _text(teacher: LLM, settings: DistillSettings, progress: bool) -> Text:
    from kvserve.eval.text import load_text

    if settings.answers:
        prompts = PROMPT_SOURCES[settings.prompts](teacher, settings.answers, settings.seed)
        return answers(teacher, settings.answers, settings.seed, states=settings.eagle, progress=progress, prompts=prompts)
    return Text(teacher.engine.tokenize(load_text(settings.text), add_special_tokens=False))


TOPICS = ["the moon", "volcanoes", "honey bees", "the Roman Empire", "electric cars", "rainbows", "ocean tides", "a lost kitten",
          "friendship", "the internet", "dinosaurs", "coffee", "the human heart", "chess", "winter", "a lighthouse keeper",
          "recycling", "the piano", "earthquakes", "a robot who learns to paint", "the Nile", "vaccines", "a haunted library",
          "gravity", "the stock market", "migrating birds", "the Great Wall of China", "a time traveler", "solar panels",
          "the water cycle", "a pirate ship", "ancient Egypt", "black holes", "a small bakery", "climate change",
          "the first airplane", "a talking tree", "algae", "the Olympic Games", "a snowstorm", "the printing press",
          "a detective in Paris", "whales", "the desert", "a space station", "the Renaissance", "a garden in spring",
          "mountains", "the brain", "a village festival", "photosynthesis", "the Moon landing", "a lonely giant", "tea",
          "Antarctica", "the immune system", "a jazz musician", "rivers", "the Vikings", "a city at night", "octopuses",
          "the Industrial Revolution", "a magic shop", "bread", "thunderstorms", "the Amazon rainforest", "a clockmaker",
          "the periodic table", "elephants", "a treehouse", "the Silk Road", "robots in factories", "autumn", "a shipwreck",
          "the human skeleton", "volunteering", "a message in a bottle", "the telescope", "coral reefs", "a marathon",
          "Shakespeare", "a forgotten key", "sleep", "the first computers", "a desert island", "wolves", "money",
          "an old map", "the Arctic fox", "a train journey", "origami", "the Eiffel Tower", "a young inventor",
          "glaciers", "the alphabet", "a beekeeper", "the speed of light", "a rainy afternoon", "mushrooms", "democracy",
          "a broken clock", "the Great Barrier Reef", "kindness", "a circus", "comets", "the ancient Greeks", "a farm",
          "electricity", "a grandmother's recipe", "owls", "the Sahara", "a school trip", "bridges", "the violin",
          "a mysterious letter", "penguins", "languages", "the Aztecs", "a wind farm", "the postal service",
          "a lighthouse in a storm", "fireflies", "the Mayans", "a lost astronaut", "cheese", "hurricanes", "the rain forest floor",
          "a street musician", "submarines", "the ancient Romans' roads", "a secret garden", "nuclear energy", "ants", "a haunted house",
          "the solar system", "a chess prodigy", "wind", "the Pyramids", "a baker's apprentice", "the human eye", "tigers",
          "a tiny village", "the Wright brothers", "sharks", "an abandoned castle", "pizza", "satellites", "a kind stranger",
          "the Great Depression", "fungi", "a music box", "trains", "the ozone layer", "a knight", "deserts at night",
          "the Mona Lisa", "a flood", "bees and flowers", "a lonely robot", "the Moon's phases", "a mountain village",
          "the Middle Ages", "frogs", "a cookbook", "the heart of a city", "fossils", "a gardener", "the first telephone",
          "polar bears", "a magic carpet", "the Arctic", "an ant colony", "medieval castles", "a runaway balloon", "salt",
          "the compass", "a busy airport", "sunflowers", "a retired sailor", "the microscope", "a football match", "lightning",
          "the Titanic", "a family dinner", "jellyfish", "the Colosseum", "a street market", "cats", "dogs", "a long winter",
          "the first vaccine", "a lost wallet", "kites", "the rainbow serpent", "a quiet library", "tornadoes"]
TASKS = ["Write a short story about {}.", "Explain {} to a child.", "Tell me three interesting facts about {}.",
         "Write a short poem about {}.", "What should everyone know about {}?", "Describe {} in a few paragraphs.",
         "Write a letter to a friend about {}.", "What are the pros and cons of {}?", "Write a dialogue about {}.",
         "Give me a short history of {}.", "How does {} work?", "Why is {} important?", "Write a news report about {}.",
         "Write a diary entry about {}.", "Summarize what you know about {} in five sentences.", "Write a speech about {}.",
         "Write a funny story about {}.", "Teach me something surprising about {}.", "Write a song about {}.",
         "Give me five questions and answers about {}.", "What would the world be like without {}?",
         "Write a fairy tale about {}."]


def chat_prompts() -> list[str]:
    """The built-in chat prompts `answers` asks: each task on each topic."""
    return [task.format(topic) for topic in TOPICS for task in TASKS]


def builtin_prompts(teacher: LLM, count: int, seed: int) -> list[str]:
    """The built-in chat prompts, shuffled by the seed (all of them: `answers` asks them again in sampled rounds)."""
    prompts = chat_prompts()
    random.Random(seed).shuffle(prompts)
    return prompts


def self_prompts(teacher: LLM, count: int, seed: int, max_tokens: int = 96, rounds: int = 8) -> list[str]:
    """`count` different user messages the model writes itself (Magpie, Xu et al. 2024): its chat template up to
    where a user's message begins, sampled at temperature 1 (seeded); only messages it ends within max_tokens.
    A chat model's own questions cover far more than built-in topics do."""
    mark = "\x00"
    template = teacher.apply_chat_template([{"role": "user", "content": mark}])
    if mark not in template:
        raise KVServeError("--prompts self needs a chat template with the user's message in it")
    start = teacher.engine.tokenize(template[:template.index(mark)], add_special_tokens=False)
    found: dict[str, None] = {}
    for round_ in range(rounds):
        wanted = count - len(found)
        params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed * 1_000_003 + round_ * count + i) for i in range(wanted)]
        for out in teacher.generate([start] * wanted, params, use_tqdm=False):
            text = out.outputs[0].text.strip()
            if text and out.outputs[0].finish_reason == "stop":
                found[text] = None
        if len(found) >= count:
            return list(found)[:count]
    raise KVServeError(f"the model wrote {len(found)} different finished user messages in {rounds} rounds, not {count}")


PROMPT_SOURCES = {"builtin": builtin_prompts, "self": self_prompts}


def answers(teacher: LLM, count: int, seed: int, max_tokens: int = 256, states: bool = False, progress: bool = False,
            prompts: list[str] | None = None) -> Text:
    """`count` answers of the target to chat prompts (default: builtin_prompts), with the prompts, as token ids: the
    text a draft is asked to predict when it serves chat (on-policy distillation, as DistillSpec's). The first
    answer to each prompt is greedy; past the prompts' number, each further round samples them (temperature 0.8,
    seeded), so no answer repeats.
    With `states`, each answer's positions only (from its prompt's last token on), each with the hidden state the
    target generated the next token from: the positions a feature draft guesses at."""
    prompts = builtin_prompts(teacher, count, seed) if prompts is None else prompts
    chats = [teacher.engine.tokenize(teacher.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
             for p in prompts[:count]]
    # Each answer's states go to a region of max_tokens rows of one buffer (pages never written are never resident).
    # Kept as the step's rows, 10,000 answers' small tensors among each step's large transient ones grew the heap
    # ~17x their size: the OOM killer took a 10,000-answer run at 19 GB, 574 answers in.
    buffer = torch.empty(count * max_tokens, teacher.engine.checkpoint.config.hidden_size) if states else None
    regions: dict[str, list[int]] = {}  # request id -> [its region's first row, rows written]

    def record(seqs, features: torch.Tensor, rows: list[int]) -> None:
        features = features.to("cpu", torch.float32)  # one copy a step from a GPU, not one a row
        for seq, row in zip(seqs, rows):
            region = regions.setdefault(seq.request_id, [len(regions) * max_tokens, 0])
            buffer[region[0] + region[1]] = features[row]
            region[1] += 1

    stop = teacher.engine.observe_features(record) if states else None
    ids, kept, starts = [], [], []
    try:
        for round_, first in enumerate(range(0, count, len(chats))):
            params = SamplingParams(temperature=0.8 if round_ else 0, max_tokens=max_tokens, seed=seed + round_)
            for chat, out in zip(chats, teacher.generate(chats[:count - first], params, use_tqdm=progress)):
                answer = out.outputs[0].token_ids
                if states:
                    ids += (chat + answer)[len(chat) - 1:-1]
                    start, rows = regions[out.request_id]
                    assert rows == len(answer), "one recorded state per answer token"
                    kept.append(buffer[start:start + rows])
                    starts += [True] + [False] * (len(answer) - 1)
                else:
                    ids += chat + answer
    finally:
        if stop is not None:
            stop()
    return Text(ids, torch.cat(kept), torch.tensor(starts)) if states else Text(ids)


def _teacher_logprobs(teacher: LLM, windows: list[list[int]]) -> torch.Tensor:
    """[windows, tokens - 1, vocab]: the target's log-probabilities of each window's next tokens."""
    outs = teacher.generate(windows, TEACHER, use_tqdm=False)
    return torch.stack([o.prompt_distributions.float() for o in outs])
