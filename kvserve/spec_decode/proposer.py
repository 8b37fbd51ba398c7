"""What every proposer shares: how many tokens to guess, and switching speculation off where guesses keep
failing (a rejected guess costs a verification row, and a model draft its own forward passes) or where guessing
steps, timed, yield fewer tokens a second than plain ones. A model proposer's prompt lookups (`lookup`) are gated
apart from its draft's guesses, so that a draft that loses does not shut the copying with it."""
from __future__ import annotations

import math
from collections import deque
from typing import Any

from kvserve.errors import KVServeError
from kvserve.spec_decode import chain
from kvserve.spec_decode.lookup import NgramIndex

# Guesses only while at most this many sequences decode in a step (each proposer's max_batch): on a 2-core CPU, 16
# decoding requests with ngram guesses ran at 0.83x; one request's verification of 5 guesses costs ~2 steps.
MAX_BATCH = 4


class SpecState:
    """Per sequence: how many tokens to guess next, and what the proposer keeps for it; and a gate: the acceptance
    of recent guesses (a sequence's own, or with a model draft one gate for all sequences; there a sequence's own
    gate judges its lookups)."""

    def __init__(self, k: int):
        self.k = k  # the next guess's length: back to one past the last accepted token after a miss, doubled after a hit
        self.paused = 0  # steps left without guesses
        self.strikes = 0  # pauses in a row: each lasts twice as long as the one before
        self.history: deque[tuple[int, int]] = deque()  # (proposed, accepted) per verification
        self.own: Any = None
        self.lookup: NgramIndex | None = None  # a model proposer's prompt-lookup index, with its `lookup` option
        self.copied = False  # the last guesses came from that lookup, not the model
        self.sources = (True, True)  # this step: whether the proposer's own guesses, and its lookups, may be made


# A failing trial pauses guessing for as many steps as make its extra time OVERHEAD of theirs, so a mild loss, as a
# rewriting answer's first sentence, pauses it briefly; each failing trial in a row doubles that, so a proposer that
# always loses nears plain decoding's pace (guesses never kept, 2 a step, over 512 tokens on a 2-core Xeon: 0.91-0.95x
# with single pauses, 0.94-0.99x doubled). Doubling once shut a random eagle draft's lookups while copying (1.00x
# where they made 1.68x): they shared its gate then, and have their own now.
OVERHEAD, MAX_PAUSE = 0.1, 1024
# Plain steps after a prompt's step or guessing ones run on caches those filled: on a 2-core Xeon the first took
# 1.14x the step of an engine without a proposer, the second 1.05x, the third 1.03x (an eagle draft, 24 guessing
# steps then 8 plain ones, over and over). Timed, they made the gate's plain steps slow enough to let eagle through
# at 0.82x of plain decoding. So the gate times a batch size's plain steps from the third in a row on.
SETTLE = 2
# A step with prompt tokens slows the steps after it longer: on that Xeon a plain engine's first decode steps of a
# request took 1.5-1.7x its later ones (in the matmul kernels: 4.2-5.3 ms against 2.9), 1.1-1.3x until the 10th to
# 20th (a pause of 25 ms between steps does alike). The gate's first plain steps, timed there, were its reference at
# 1.3-2x the plain engine's steps, and eagle's trials passed at 1.2-1.7x where it ran at 0.88x. So the gate times
# no step, plain or guessing, within WARM steps after one with prompt tokens. Timings due wait until after them while
# guessing goes on (a new engine's first answer guesses from its first steps), but for a failing trial's second look.
WARM = 16
# plain steps a gate times at a time: a batch size's first, a probe's, a failing trial's second look
TIMED = 2


class CostGate:
    """Whether guessing pays, timed: each batch size's decode-only steps with guesses against its recent steps
    without. The acceptance gate counts kept guesses, not what they cost, which hardware and dtype decide (an
    H200's fp32 steps once cost 1.8x a step to verify two guesses, where a CPU's cost ~1.2x: eagle kept as many
    guesses there and ran at 0.88x)."""

    def __init__(self, min_speedup: int, trial: int = 16, probe_every: int = 128):
        """Every `trial` guessing steps of a batch size, their tokens a second against the faster of its last two
        timed plain steps (what interrupts a step only ever adds to its time: a median of three, one of them an 8 ms
        outlier among 3.4 ms steps, let eagle's trials pass at 0.8x for a hundred steps); below min_speedup percent,
        two plain steps are timed and the trial judged again against them (a machine that slowed down during the trial
        slows them too), and if it still falls short, a pause (OVERHEAD). A batch size's first steps, and two after
        its first trial and after every `probe_every` guessing steps since (contexts grow, steps slow down), run plain
        to time it: an engine's first plain steps, timed alone, ran 1.3-1.4x its later ones on a 2-core Xeon, and
        eagle passed trials against them for 224 guessing steps at 0.89-0.94x of plain decoding. 0: off. The
        proposers' 90 lets a CPU's marginal gains be: at 95, noisy trials shut eagle on open prompts (1.02x where it
        ran at 1.05x ungated); 8-step trials, noisier, kept 2.58 tokens a step of eagle's 2.95 rewriting. Judged
        against plain steps timed before it alone, a trial of guesses that were all kept (4 tokens a step) was once
        shut by a test run beside it. Only plain steps that follow SETTLE plain steps of their batch size are timed."""
        self.min_speedup, self.trial, self.probe_every = min_speedup, trial, probe_every
        self.plain: dict[int, deque[float]] = {}  # batch size -> its recent plain steps' seconds a token
        self.untimed: dict[int, int] = {}  # batch size -> plain steps to time before it guesses again (TIMED at first)
        self.probed: set[int] = set()  # batch sizes probed since their first trial
        self.since_plain: dict[int, int] = {}  # batch size -> guessing steps since its last plain one
        self.spent: dict[int, list[float]] = {}  # batch size -> this trial's [seconds, tokens, steps]
        self.failed: dict[int, list[float]] = {}  # batch size -> a failing trial's [seconds, tokens, plain steps to time]
        self.plain_run = (0, 0)  # (batch size, plain decode-only steps of it in a row, up to the last step)
        self.paused = 0
        self.strikes = 0  # failing trials in a row: each doubles the next one's pause

    def begin_step(self, size: int) -> bool:
        """A step with `size` sequences decoding starts: whether this gate's guesses may run (a pause counts every
        step); needs_plain says whether the step must run without any."""
        if self.paused:
            self.paused -= 1
            return False
        return True

    def needs_plain(self, size: int) -> bool:
        """Whether the step runs with no guesses, to be timed: the batch size's first plain steps or a probe's are
        not all timed yet, or a failing trial waits for its second look."""
        return self.must_wait(size) or (bool(self.min_speedup) and self.untimed.get(size, TIMED) > 0)

    def must_wait(self, size: int) -> bool:
        """Whether guessing must wait for plain steps to be timed where other timings can wait: a failing trial waits
        for its second look."""
        return bool(self.min_speedup) and size in self.failed

    def record(self, size: int, guessed: bool, seconds: float, tokens: int, decode_only: bool = True, features: bool = False) -> None:
        """A step of `size` sequences decoding: whether any guessed, its seconds and the tokens it gave; only a
        decode-only step is timed, and a plain one only where it kept no hidden states for a feature draft (a plain
        engine never picks them; they cost a paused eagle engine's steps 4%)."""
        plain = decode_only and not guessed
        self.plain_run = (size, self.plain_run[1] + 1 if plain and self.plain_run[0] == size else int(plain))
        if not self.min_speedup or not tokens or not decode_only:
            return
        if not guessed:
            if self.plain_run[1] <= SETTLE or features:
                return
            self.plain.setdefault(size, deque(maxlen=TIMED)).append(seconds / tokens)
            self.since_plain[size] = 0
            self.untimed[size] = max(0, self.untimed.get(size, TIMED) - 1)
            if size in self.failed:
                failed = self.failed[size]
                failed[2] -= 1
                if not failed[2]:
                    del self.failed[size]
                    self._judge(size, failed[0], failed[1], again=True)
            return
        if size not in self.plain:  # the guesses were made for a batch of another size
            return
        self.since_plain[size] += 1
        if self.since_plain[size] >= (self.probe_every if size in self.probed else self.trial):
            self.probed.add(size)
            self.untimed[size] = TIMED
        spent = self.spent.setdefault(size, [0.0, 0, 0])
        spent[0], spent[1], spent[2] = spent[0] + seconds, spent[1] + tokens, spent[2] + 1
        if spent[2] >= self.trial:
            del self.spent[size]
            self._judge(size, spent[0], spent[1], again=False)

    def _judge(self, size: int, seconds: float, tokens: int, again: bool) -> None:
        """A trial of guessing steps that took `seconds` for `tokens`, against the batch size's recent plain steps."""
        speedup = min(self.plain[size]) * tokens / seconds
        if 100 * speedup >= self.min_speedup:
            self.strikes = 0
            return
        if not again:
            self.failed[size] = [seconds, tokens, TIMED]
            return
        # the trial's extra time: at most OVERHEAD of the steps until the next; half that share for each failing trial before
        self.paused = min(math.ceil(self.trial * (1 / speedup - 1) / OVERHEAD) << min(self.strikes, 10), MAX_PAUSE)
        self.strikes += 1


def check_ints(**options) -> None:
    for name, value in options.items():
        if not isinstance(value, int):
            raise KVServeError(f"speculative option {name} must be an integer, got {value!r}")


class Proposer:
    shared_gate = False  # one gate for all sequences: a model draft's quality is the draft's, not the text's

    def __init__(self, k: int, min_acceptance: int, window: int, lookup: int = 0, *, max_batch: int = MAX_BATCH, min_speedup: int = 90):
        """Guesses of up to k tokens. Where the last `window` proposed tokens were accepted less than min_acceptance
        percent of the time, no guesses for `window` steps, twice as many after each further failing window (up to
        64x). No guesses in a step where more than max_batch sequences decode: a batch's step is compute-bound on a
        CPU, so every guess row costs about what a token does. lookup > 0 (the model proposers): where a sequence's
        last 3 tokens occurred earlier in its prompt or output, up to `lookup` tokens that followed them there
        instead of the model's (prompt lookup, as `ngram` guesses): text that copies its context gets several tokens
        a step, and no draft step. min_speedup: see CostGate (percent; 0: off)."""
        check_ints(k=k, min_acceptance=min_acceptance, window=window, max_batch=max_batch, lookup=lookup, min_speedup=min_speedup)
        if not 1 <= k <= 16 or not 0 <= min_acceptance <= 100 or window < 1 or max_batch < 1 or not 0 <= lookup <= 16 or min_speedup < 0:
            raise KVServeError(f"speculative decoding needs 1 <= k <= 16, 0 <= min_acceptance <= 100, window >= 1, max_batch >= 1, "
                               f"0 <= lookup <= 16 and min_speedup >= 0, got k={k}, min_acceptance={min_acceptance}, "
                               f"window={window}, max_batch={max_batch}, lookup={lookup}, min_speedup={min_speedup}")
        self.k, self.min_acceptance, self.window, self.max_batch, self.lookup = k, min_acceptance, window, max_batch, lookup
        self.shared = SpecState(k)
        # the proposer's own guesses' cost gate, then its lookups': a random feature draft shut the copying with its
        # own losses when they shared one (bench/speculative.py --workloads copy: 0.88x, where ngram ran at 1.60x)
        self.costs = [CostGate(min_speedup) for _ in range(1 + bool(lookup))]
        self.open = [True] * len(self.costs)  # this step: whether each may guess
        self.timing = False  # this step runs plain for a cost gate to time it (or, WARM, until it can)
        self.warming = 0  # steps left that the cost gates do not time, after one with prompt tokens (WARM)
        self.decoding = 0  # sequences decoding in this step

    def start(self, engine) -> None:
        """Load what the proposer needs from the engine it serves (a draft model, the target's layers)."""

    def guesses(self, seqs: list, limits: list[int]) -> list[list[int]]:
        """Up to `limit` guessed next tokens for each sequence: prompt lookup's where `lookup` finds the text's last
        tokens before, else the proposer's own (up to its k), one batch for all; each only while its gates are open
        (lookahead)."""
        guesses = [self._look_up(seq, limit) for seq, limit in zip(seqs, limits)]
        rest = [i for i, found in enumerate(guesses) if not found and self.state(seqs[i]).sources[0]]
        if rest:
            own = self.propose([seqs[i] for i in rest], [min(limits[i], self.state(seqs[i]).k) for i in rest])
            for i, found in zip(rest, own):
                guesses[i] = found
        return guesses

    def propose(self, seqs: list, limits: list[int]) -> list[list[int]]:
        """The proposer's own guesses: up to `limit` next tokens for each sequence, one batch for all."""
        raise NotImplementedError

    def _look_up(self, seq, limit: int) -> list[int]:
        """Prompt lookup's guesses (none without `lookup`); the sequence's state remembers whether it made them."""
        state = self.state(seq)
        state.copied = False
        if not self.lookup or not state.sources[1]:
            return []
        state.lookup = state.lookup or NgramIndex(3, 3)
        copied = state.lookup.continuation(seq.token_ids, limit)
        state.copied = bool(copied)
        return copied

    def parents(self, seq, count: int) -> list[int]:
        """The tree of the `count` guesses `propose` just made for a sequence: each one's parent guess (-1: the
        sequence's newest token), parents first. A chain: each guess follows the one before."""
        return chain(count)

    def begin_step(self, decoding: int) -> bool:
        """A step with `decoding` sequences decoding starts: whether they may guess (not past max_batch, nor while
        both cost gates are shut, nor where one needs a plain step timed). A shared gate's pause counts steps (a
        sequence's own counts its steps in lookahead)."""
        if self.shared_gate and self.shared.paused > 0:
            self.shared.paused -= 1
        self.open = [gate.begin_step(decoding) for gate in self.costs]  # every pause counts the step
        plain = [gate.must_wait(decoding) if self.warming else gate.needs_plain(decoding) for gate in self.costs]
        self.timing = decoding > 0 and any(is_open and p for is_open, p in zip(self.open, plain))
        if self.timing:
            self.open = [False] * len(self.costs)
        self.decoding = decoding
        return any(self.open) and decoding <= self.max_batch

    def lookahead(self, seq) -> int:
        """How many tokens to guess for this sequence, or 0 while its gates are shut: the proposer's own guesses'
        (shared by all sequences with a model draft) and its lookups' (each sequence's own, as ngram's)."""
        state = self.state(seq)
        state.sources = (self.open[0] and self._accepting(self.shared if self.shared_gate else state),
                         self.lookup > 0 and self.open[-1] and self._accepting(state))
        return max(state.k if state.sources[0] else 0, self.lookup if state.sources[1] else 0)  # own guesses stay within k

    def may_guess_next(self) -> bool:
        """Whether the proposer's own guesses may be made in the next step (a feature draft needs this step's hidden
        states only then): not while its cost gate, or a shared acceptance gate, pauses them past it (both pauses
        count down at a step's start, begin_step, the shared one read after), nor past max_batch. Nor after a step
        a cost gate times: so that it is timed as a plain engine's, it keeps none, and the draft's guesses wait a
        step more after the last."""
        return (self.costs[0].paused == 0 and (not self.shared_gate or self.shared.paused <= 1)
                and not self.timing and self.decoding <= self.max_batch)

    def _accepting(self, gate: SpecState) -> bool:
        """Whether an acceptance gate is open; a sequence's own gate counts its steps here."""
        if gate.paused > 0:
            if gate is not self.shared:
                gate.paused -= 1
            return False
        return True

    def record(self, seq, proposed: int, accepted: int) -> None:
        """After verification: the next guess's length (a tree's: its deepest path), and the gate."""
        state = self.state(seq)
        state.k = min(self.k, 2 * state.k if accepted >= min(proposed, state.k) else accepted + 1)
        gate = self.shared if self.shared_gate and not state.copied else state
        gate.history.append((proposed, accepted))
        total = sum(p for p, _ in gate.history)
        while total - gate.history[0][0] >= self.window:
            total -= gate.history.popleft()[0]
        if total < self.window:
            return
        if 100 * sum(a for _, a in gate.history) < self.min_acceptance * total:
            gate.paused, gate.history = self.window << min(gate.strikes, 6), deque()
            gate.strikes += 1
        else:
            gate.strikes = 0

    def timed(self, seqs: list, seconds: float, tokens: int, decode_only: bool = True, features: bool = False) -> None:
        """A step of these sequences, for the cost gates: a gate's guessing step where its guesses ran in it, a
        plain step where none did; a step where only the other gate's ran is neither (nor is the plain one after), nor
        is one within WARM steps after a step with prompt tokens. `features`: the step kept hidden states for a
        feature draft."""
        if not decode_only:
            self.warming = WARM
        elif self.warming:
            self.warming -= 1
            decode_only = False
        sources = {int(self.state(seq).copied) for seq in seqs if seq.draft_token_ids}
        for source, gate in enumerate(self.costs):
            mine = source in sources
            gate.record(len(seqs), mine, seconds, tokens, decode_only=decode_only and (mine or not sources), features=features)

    def forget(self, seq) -> None:
        """The sequence finished: let go of what the proposer holds for it."""

    def state(self, seq) -> SpecState:
        if seq.spec_state is None:
            seq.spec_state = SpecState(self.k)
        return seq.spec_state
