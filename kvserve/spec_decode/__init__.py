"""Speculative decoding: a proposer guesses each decoding sequence's next k tokens; one forward pass scores them
all (the runner samples at every guess), `verify` keeps the guesses the samples confirm plus one sample, and the
rejected positions' K/V are rolled back (engine/output.py). The guesses may be a tree (a proposer's `parents`):
each guess attends to the guesses it descends from only, and the path the samples confirm is moved to the
slots after the newest token (model_runner.py).

`speculative` (proposers.py) is one string `NAME[:key=value,...]`: `ngram:k=4` (prompt lookup),
`draft:model=PATH,k=4` (a small model with the target's tokenizer), `self:layers=10` (the target's first layers).
"""
from __future__ import annotations


def chain(count: int) -> list[int]:
    """The parents of `count` guesses in a row: each guess follows the one before (-1: the newest token)."""
    return list(range(-1, count - 1))


def path(parents: list[int], node: int) -> list[int]:
    """The guesses from the first one under the newest token down to `node` (-1: none), in order."""
    nodes = []
    while node >= 0:
        nodes.append(node)
        node = parents[node]
    return nodes[::-1]


def depths(parents: list[int]) -> list[int]:
    """Each guess's depth under the newest token: 1 for its children (parents come first)."""
    depth: list[int] = []
    for parent in parents:
        depth.append(1 + (depth[parent] if parent >= 0 else 0))
    return depth


def hidden_keys(parents: list[int]) -> list[int]:
    """Per guess, the earlier guesses its attention skips, those it does not descend from: bit j - 1 - i for guess
    i before guess j (guess i's key lies j - i slots before j's, after the newest token's). Zero for a chain."""
    masks = []
    for j in range(len(parents)):
        ancestors = set(path(parents, parents[j]))
        masks.append(sum(1 << (j - 1 - i) for i in range(j) if i not in ancestors))
    return masks


def verify(guesses: list[int], parents: list[int], samples: list[int]) -> tuple[list[int], list[int]]:
    """The tokens a sequence keeps, and the guesses they are: from the newest token down its tree of guesses
    (`parents`; samples[0] is the newest token's sample, samples[1 + i] guess i's), the guess under the current one
    that equals the current one's sample, while there is one; then that sample. This is speculative sampling's rule
    for a draft that proposes its tokens for certain (q = 1 at each guess): a guess x is kept with probability p(x),
    and a rejection's token is distributed as p without the guesses, renormalized. So the output is distributed
    exactly as the target's samples, at any temperature, top-p, top-k or penalty."""
    tokens, kept, node = [], [], -1
    while True:
        sample = samples[1 + node]
        tokens.append(sample)
        child = next((i for i in range(node + 1, len(guesses)) if parents[i] == node and guesses[i] == sample), None)
        if child is None:
            return tokens, kept
        kept.append(child)
        node = child
