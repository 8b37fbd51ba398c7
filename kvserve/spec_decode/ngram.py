"""Prompt lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of the sequence's
last n tokens, in its prompt or its output. No model: strong when the output copies the input (editing,
summaries, code, RAG)."""
from __future__ import annotations

from collections import deque

from kvserve.errors import KVServeError


class NgramProposer:
    def __init__(self, k: int = 4, n: int = 3, min_n: int = 2, min_acceptance: int = 20, window: int = 32):
        """k tokens per proposal from the longest matching n-gram (n down to min_n). A sequence whose last `window`
        proposed tokens were accepted less than min_acceptance percent of the time stops proposing for as long."""
        if not 1 <= k <= 16 or not 1 <= min_n <= n <= 8 or not 0 <= min_acceptance <= 100 or window < 1:
            raise KVServeError(f"ngram needs 1 <= k <= 16 and 1 <= min_n <= n <= 8 and 0 <= min_acceptance <= 100, "
                               f"got k={k}, n={n}, min_n={min_n}, min_acceptance={min_acceptance}")
        self.k, self.n, self.min_n, self.min_acceptance, self.window = k, n, min_n, min_acceptance, window

    def propose(self, seq, limit: int) -> list[int]:
        """Up to min(k, limit) tokens for `seq`, from the latest earlier occurrence of its last n-gram."""
        state = seq.spec_state
        if state is None:
            state = seq.spec_state = NgramState(self.min_n, self.n)
        if state.paused > 0:
            state.paused -= 1
            return []
        tokens = seq.token_ids
        state.index(tokens)
        for n in range(self.n, self.min_n - 1, -1):
            start = state.last_seen[n - self.min_n].get(tuple(tokens[-n:])) if len(tokens) > n else None
            if start is not None:
                return tokens[start + n:start + n + min(self.k, limit)]
        return []

    def record(self, seq, proposed: int, accepted: int) -> None:
        """After verification: pause a sequence whose guesses keep failing (speculation would only cost)."""
        state = seq.spec_state
        state.history.append((proposed, accepted))
        total = sum(p for p, _ in state.history)
        while total - state.history[0][0] >= self.window:
            total -= state.history.popleft()[0]
        if total >= self.window and 100 * sum(a for _, a in state.history) < self.min_acceptance * total:
            state.paused, state.history = self.window, deque()


class NgramState:
    """Per sequence: for each n, the latest start of every n-gram that ends before the last token (so it has a
    continuation), indexed as tokens arrive."""

    def __init__(self, min_n: int, max_n: int):
        self.sizes = range(min_n, max_n + 1)
        self.last_seen: list[dict[tuple[int, ...], int]] = [{} for _ in self.sizes]
        self.next_start = [0 for _ in self.sizes]
        self.paused = 0
        self.history: deque[tuple[int, int]] = deque()

    def index(self, tokens: list[int]) -> None:
        for i, n in enumerate(self.sizes):
            seen, stop = self.last_seen[i], len(tokens) - n  # starts s with s + n <= len(tokens) - 1
            for s in range(self.next_start[i], stop):
                seen[tuple(tokens[s:s + n])] = s
            self.next_start[i] = max(self.next_start[i], stop)
