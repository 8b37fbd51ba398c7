"""Passkey retrieval (Mohtashami and Jaggi, 2023): a random 5-digit key hidden at a depth of a filler context;
the model is asked for it and answers greedily."""
from __future__ import annotations

import random
from dataclasses import dataclass

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n\n")
QUESTION = "\n\nWhat is the pass key? The pass key is"


@dataclass(frozen=True, slots=True)
class PasskeyPrompt:
    length: int  # the context length asked for (the prompt is at most this long)
    depth: int  # percent of the filler before the key
    key: str
    token_ids: list[int]


def passkey_prompts(engine, lengths: list[int], depths: list[int], trials: int, seed: int) -> list[PasskeyPrompt]:
    rng, prompts = random.Random(seed), []
    filler = len(engine.tokenize(FILLER, add_special_tokens=False))
    for length in lengths:
        for depth in depths:
            for _ in range(trials):
                key = str(rng.randint(10000, 99999))
                needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
                fixed = len(engine.tokenize(INTRO + needle + QUESTION))
                repeats = max(0, (length - fixed) // filler)
                before = round(repeats * depth / 100)
                text = INTRO + FILLER * before + needle + FILLER * (repeats - before) + QUESTION
                prompts.append(PasskeyPrompt(length, depth, key, engine.tokenize(text)))
    return prompts
