"""Stop strings: a stream never shows text that a stop string later cuts, so streamed text always equals the
finished text, wherever the stop string falls among the tokens."""
from __future__ import annotations

import pytest

from kvserve import SamplingParams

NUMBERS = "List the numbers from one to ten in words, separated by commas:"  # the issue's: ' "123,456,789,000,...'
SEA = "Write one sentence about the sea:"  # word-sized tokens


@pytest.fixture(scope="module")
def reference(smollm2):
    out = smollm2.generate(SEA, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    ends = [len(smollm2.tokenizer.decode(out.outputs[0].token_ids[: i + 1])) for i in range(len(out.outputs[0].token_ids))]
    return out.outputs[0].text, ends  # where each token's text ends in the output


def _stop(case: str, text: str, ends: list[int]) -> tuple[str, str]:
    """(prompt, stop string) for a case."""
    if case == "the issue's 9,0":
        return NUMBERS, "9,0"
    long_token = next(i for i in range(4, len(ends)) if ends[i] - ends[i - 1] >= 4)
    a, b = ends[long_token - 1], ends[long_token]
    return SEA, {"inside one token": text[a + 1:b - 1], "across two tokens": text[ends[3] - 1:ends[3] + 1],
                 "across three tokens": text[ends[3] - 1:ends[5] + 1], "at the first token": text[:ends[0]]}[case]


def _streamed(llm, prompt: str, params: SamplingParams) -> tuple[str, str]:
    parts, last = [], None
    for out in llm.stream(prompt, params):
        parts.append(out.outputs[0].new_text)
        assert out.outputs[0].text == "".join(parts)  # every output's text is what the stream has shown
        last = out
    return "".join(parts), last.outputs[0].text


@pytest.mark.parametrize("case", ["inside one token", "across two tokens", "across three tokens", "at the first token",
                                  "the issue's 9,0"])
def test_streamed_text_equals_finished_text(smollm2, reference, case):
    prompt, stop = _stop(case, *reference)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    text = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    whole = smollm2.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
    streamed, final = _streamed(smollm2, prompt, params)
    assert stop in text
    assert whole == streamed == final == text[: text.find(stop)]


def test_text_that_only_starts_a_stop_string_is_shown_once_it_cannot_stop(smollm2, reference):
    text, _ = reference
    almost = text[2:6] + "\u2603"  # starts like the output, then never matches
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[almost])
    streamed, final = _streamed(smollm2, SEA, params)
    assert streamed == final == text
