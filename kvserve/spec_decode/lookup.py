"""Prompt lookup's index: where each recent n-gram of a sequence's tokens last occurred, so the tokens that
followed it there can be guessed next (the `ngram` proposer's guesses, and the model proposers' `lookup`)."""
from __future__ import annotations


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
