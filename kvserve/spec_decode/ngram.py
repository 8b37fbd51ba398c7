"""Prompt lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of the sequence's
last n tokens, in its prompt or its output. No model: strong when the output copies the input (editing,
summaries, code, RAG)."""
from __future__ import annotations

from kvserve.errors import KVServeError
from kvserve.spec_decode.proposer import MAX_BATCH, Proposer, check_ints


class NgramProposer(Proposer):
    def __init__(self, k: int = 5, n: int = 3, min_n: int = 2, min_acceptance: int = 20, window: int = 32, max_batch: int = MAX_BATCH):
        """Up to k tokens per proposal from the longest matching n-gram (n down to min_n). k = 5 keeps a guessing
        sequence's step at 6 rows, within the rows quantized weights multiply in place (layers/linear.py: kernel_rows)."""
        super().__init__(k, min_acceptance, window, max_batch)
        check_ints(n=n, min_n=min_n)
        if not 1 <= min_n <= n <= 8:
            raise KVServeError(f"ngram needs 1 <= min_n <= n <= 8, got n={n}, min_n={min_n}")
        self.n, self.min_n = n, min_n

    def propose(self, seqs: list, limits: list[int]) -> list[list[int]]:
        return [self._propose(seq, limit) for seq, limit in zip(seqs, limits)]

    def _propose(self, seq, limit: int) -> list[int]:
        state = self.state(seq)
        state.own = state.own or NgramIndex(self.min_n, self.n)
        return state.own.continuation(seq.token_ids, limit)


class NgramIndex:
    """For each n, the latest start of every n-gram that ends before the last token (so it has a continuation),
    indexed as tokens arrive."""

    def __init__(self, min_n: int, max_n: int):
        self.sizes = range(min_n, max_n + 1)
        self.last_seen: list[dict[tuple[int, ...], int]] = [{} for _ in self.sizes]
        self.next_start = [0 for _ in self.sizes]

    def continuation(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest n-gram `tokens` ends with
        (the new tokens indexed first)."""
        self.add(tokens)
        for i in reversed(range(len(self.sizes))):
            n = self.sizes[i]
            start = self.last_seen[i].get(tuple(tokens[-n:])) if len(tokens) > n else None
            if start is not None:
                return tokens[start + n:start + n + limit]
        return []

    def add(self, tokens: list[int]) -> None:
        for i, n in enumerate(self.sizes):
            seen, stop = self.last_seen[i], len(tokens) - n  # starts s with s + n <= len(tokens) - 1
            for s in range(self.next_start[i], stop):
                seen[tuple(tokens[s:s + n])] = s
            self.next_start[i] = max(self.next_start[i], stop)
