"""The proposers by name, and the `speculative` option string that picks one."""
from __future__ import annotations

from kvserve.errors import KVServeError
from kvserve.spec_decode.draft import DraftProposer, SelfProposer
from kvserve.spec_decode.eagle import EagleProposer
from kvserve.spec_decode.ngram import NgramProposer
from kvserve.spec_decode.proposer import Proposer

PROPOSERS = {"ngram": NgramProposer, "draft": DraftProposer, "self": SelfProposer, "eagle": EagleProposer}


def parse_speculative(text: str) -> Proposer:
    """'ngram:k=4,n=3' -> a proposer (not started); a clear error naming what is wrong."""
    name, _, args = text.partition(":")
    if name not in PROPOSERS:
        raise KVServeError(f"unknown speculative proposer {name!r}; choose from {', '.join(PROPOSERS)}")
    options: dict[str, int | str] = {}
    for item in filter(None, (part.strip() for part in args.split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not key or not value:
            raise KVServeError(f"speculative option {item!r} is not name=value")
        options[key] = int(value) if value.lstrip("-").isdigit() else value
    try:
        return PROPOSERS[name](**options)
    except TypeError as e:
        raise KVServeError(f"bad options for the {name} proposer: {e}") from None
