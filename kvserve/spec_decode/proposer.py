"""What every proposer shares: k, and switching speculation off for a sequence whose guesses keep failing
(a rejected guess costs a verification row, and a model draft its own forward passes)."""
from __future__ import annotations

from collections import deque
from typing import Any

from kvserve.errors import KVServeError


class SpecState:
    """Per sequence: the acceptance of its recent guesses, and what the proposer keeps for it."""

    def __init__(self):
        self.paused = 0  # steps left without guesses
        self.strikes = 0  # pauses in a row: each lasts twice as long as the one before
        self.history: deque[tuple[int, int]] = deque()  # (proposed, accepted) per verification
        self.own: Any = None


def check_ints(**options) -> None:
    for name, value in options.items():
        if not isinstance(value, int):
            raise KVServeError(f"speculative option {name} must be an integer, got {value!r}")


class Proposer:
    def __init__(self, k: int, min_acceptance: int, window: int):
        """A sequence whose last `window` proposed tokens were accepted less than min_acceptance percent of the
        time gets no guesses for `window` steps, twice as many after each further failing window (up to 32x)."""
        check_ints(k=k, min_acceptance=min_acceptance, window=window)
        if not 1 <= k <= 16 or not 0 <= min_acceptance <= 100 or window < 1:
            raise KVServeError(f"speculative decoding needs 1 <= k <= 16, 0 <= min_acceptance <= 100 and window >= 1, "
                               f"got k={k}, min_acceptance={min_acceptance}, window={window}")
        self.k, self.min_acceptance, self.window = k, min_acceptance, window

    def start(self, engine) -> None:
        """Load what the proposer needs from the engine it serves (a draft model, the target's layers)."""

    def propose(self, seqs: list, limits: list[int]) -> list[list[int]]:
        """Up to min(k, limit) guessed next tokens for each sequence, one batch for all."""
        raise NotImplementedError

    def wants(self, seq) -> bool:
        """Whether to ask for guesses for this sequence this step (counts down a pause)."""
        state = self.state(seq)
        if state.paused > 0:
            state.paused -= 1
            return False
        return True

    def record(self, seq, proposed: int, accepted: int) -> None:
        """After verification: pause a sequence whose guesses keep failing."""
        state = self.state(seq)
        state.history.append((proposed, accepted))
        total = sum(p for p, _ in state.history)
        while total - state.history[0][0] >= self.window:
            total -= state.history.popleft()[0]
        if total < self.window:
            return
        if 100 * sum(a for _, a in state.history) < self.min_acceptance * total:
            state.paused, state.history = self.window << min(state.strikes, 5), deque()
            state.strikes += 1
        else:
            state.strikes = 0

    def forget(self, seq) -> None:
        """The sequence finished: let go of what the proposer holds for it."""

    @staticmethod
    def state(seq) -> SpecState:
        if seq.spec_state is None:
            seq.spec_state = SpecState()
        return seq.spec_state
