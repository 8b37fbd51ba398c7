"""Speculative decoding: a proposer guesses each decoding sequence's next k tokens; one forward pass scores them
all (the runner samples at every guess), `verify` keeps the guesses the samples confirm plus one sample, and the
rejected positions' K/V are rolled back (engine/output.py).

`speculative` (proposers.py) is one string `NAME[:key=value,...]`: `ngram:k=4` (prompt lookup),
`draft:model=PATH,k=4` (a small model with the target's tokenizer), `self:layers=10` (the target's first layers).
"""
from __future__ import annotations


def verify(guesses: list[int], samples: list[int]) -> list[int]:
    """The tokens a sequence keeps: its guesses while each equals the target's sample at its position, then the
    first sample that differs (or the one after the last guess). This is speculative sampling's rule for a draft
    that proposes one token for certain (q = 1 at the guess): a guess x is kept with probability min(1, p(x) / 1) =
    p(x), and a rejection's token is distributed as p without x, renormalized, i.e. max(0, p - q). So the output is
    distributed exactly as the target's samples, at any temperature, top-p, top-k or penalty."""
    kept = 0
    while kept < len(guesses) and samples[kept] == guesses[kept]:
        kept += 1
    return guesses[:kept] + [samples[kept]]
