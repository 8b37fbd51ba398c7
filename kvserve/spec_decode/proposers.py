"""The proposers by name, and the `speculative` option string that picks one."""
from __future__ import annotations

import inspect

from kvserve.config import parse_named
from kvserve.errors import KVServeError
from kvserve.spec_decode.draft import DraftProposer, SelfProposer
from kvserve.spec_decode.eagle import EagleProposer
from kvserve.spec_decode.ngram import NgramProposer
from kvserve.spec_decode.proposer import Proposer

PROPOSERS = {"ngram": NgramProposer, "draft": DraftProposer, "self": SelfProposer, "eagle": EagleProposer}


def parse_speculative(text: str) -> Proposer:
    """'ngram:k=4,n=3' -> a proposer (not started); a clear error naming what is wrong."""
    name, given = parse_named(text, "speculative")
    if name not in PROPOSERS:
        raise KVServeError(f"unknown speculative proposer {name!r}; choose from {', '.join(PROPOSERS)}")
    known = options(PROPOSERS[name])
    if unknown := [key for key in given if key not in known]:
        raise KVServeError(f"the {name} proposer has no option {unknown[0]}; it takes {', '.join(known)}")
    return PROPOSERS[name](**{key: int(value) if value.lstrip("-").isdigit() else value for key, value in given.items()})


def options(cls: type[Proposer]) -> list[str]:
    """The options a proposer takes: its own, then the base class's keyword-only ones it passes on (its **gate)."""
    own = inspect.signature(cls.__init__).parameters.values()
    names = [p.name for p in own if p.name != "self" and p.kind is not p.VAR_KEYWORD]
    if any(p.kind is p.VAR_KEYWORD for p in own):
        names += [p.name for p in inspect.signature(Proposer.__init__).parameters.values() if p.kind is p.KEYWORD_ONLY]
    return names
