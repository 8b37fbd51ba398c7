"""Speculative decoding: a proposer guesses each decoding sequence's next k tokens; one forward pass scores them
all (the runner samples at every guess), `verify` keeps the guesses the samples confirm plus one sample, and the
rejected positions' K/V are rolled back (engine/output.py).

`speculative` is one string `NAME[:key=value,...]`, e.g. `ngram:k=4`.
"""
from __future__ import annotations

from kvserve.errors import KVServeError
from kvserve.spec_decode.ngram import NgramProposer

PROPOSERS = {"ngram": NgramProposer}


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


def parse_speculative(text: str):
    """'ngram:k=4,n=3' -> a proposer; a clear error naming what is wrong."""
    name, _, args = text.partition(":")
    if name not in PROPOSERS:
        raise KVServeError(f"unknown speculative proposer {name!r}; choose from {', '.join(PROPOSERS)}")
    options = {}
    for item in filter(None, (part.strip() for part in args.split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        try:
            options[key] = int(value)
        except ValueError:
            raise KVServeError(f"speculative option {item!r} is not name=integer") from None
        if not sep:
            raise KVServeError(f"speculative option {item!r} is not name=integer")
    try:
        return PROPOSERS[name](**options)
    except TypeError as e:
        raise KVServeError(f"bad options for the {name} proposer: {e}") from None
