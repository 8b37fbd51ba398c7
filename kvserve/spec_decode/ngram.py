"""Prompt lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of the sequence's
last n tokens, in its prompt or its output. No model: strong when the output copies the input (editing,
summaries, code, RAG)."""
from __future__ import annotations

from kvserve.errors import KVServeError
from kvserve.spec_decode.lookup import NgramIndex
from kvserve.spec_decode.proposer import Proposer, check_ints


class NgramProposer(Proposer):
    def __init__(self, k: int = 6, n: int = 3, min_n: int = 2, min_acceptance: int = 20, window: int = 32, **gate):
        """Up to k tokens per proposal from the longest matching n-gram (n down to min_n). A copied run of text
        gives a guess every hit doubles, up to k, so k bounds the tokens a step makes there: on a 2-core Xeon,
        `bench/speculative.py --workloads copy` printed 1.53-1.69x at k=5, 1.65-1.81x at 6, 1.74-1.86x at 8 (side by
        side over 9 rounds, 1.75x at 6 and 1.76x at 8) and 1.71x at 10. At 6, the most sequences that guess together
        (max_batch, 4) make steps of 28 rows, within the 31 that the int8 kernels multiply exactly as one-row steps on
        a CPU with AMX (kernels/quant_matmul.cpp)."""
        super().__init__(k, min_acceptance, window, 0, **gate)  # no lookup option: it is one
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
