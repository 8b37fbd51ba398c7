"""vLLM-shaped outputs, and n > 1 completions that share one prefill: the others fork from the prompt's blocks
(full blocks shared, the partly filled last one copied on write)."""
from __future__ import annotations

import gc
import threading
import weakref

import pytest

from kvserve import LLM, KVServeError, SamplingParams
from tests.conftest import FP32

PROMPT = "Write a short story about a dragon who learns to program computers. The dragon lives in a cave " * 2


def test_vllm_shape(smollm2):
    out = smollm2.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=1, stop_token_ids=[]), use_tqdm=False)[0]
    assert out.finished and out.prompt == PROMPT and out.prompt_token_ids == smollm2.engine.tokenize(PROMPT)
    (c,) = out.outputs
    assert c.index == 0 and len(c.token_ids) == 6 and c.finish_reason == "length" and c.stop_reason is None
    assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in c.logprobs)) and c.text
    stopped = smollm2.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[c.token_ids[2]]), use_tqdm=False)
    assert stopped[0].outputs[0].stop_reason == c.token_ids[2]


def test_prompt_token_ids_dicts(smollm2):
    ids = smollm2.engine.tokenize("The capital of France is")
    by_ids, by_text = smollm2.generate([{"prompt_token_ids": ids}, {"prompt": "The capital of France is"}],
                                       SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids and by_text.prompt == "The capital of France is"
    with pytest.raises(KVServeError, match="a prompt dict needs 'prompt' or 'prompt_token_ids'"):
        smollm2.generate([{"text": "hi"}])


def test_n_completions_share_one_prefill_and_equal_separate_requests():
    llm = LLM("smollm2-135m", kv_cache_memory="64MiB", enable_prefix_caching=False, **FP32)
    engine, n = llm.engine, 4
    prompt_len = len(engine.tokenize(PROMPT))
    engine.add_request(PROMPT, SamplingParams(n=n, temperature=0.8, seed=11, max_tokens=10, ignore_eos=True))
    prefill, outputs = 0, []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        prefill += engine.last_step.prefill_tokens
    out = outputs[-1]
    assert out.finished and [c.index for c in out.outputs] == list(range(n))
    assert prefill == prompt_len  # one prefill, not n
    assert out.metrics.forked_blocks == (n - 1) * (prompt_len // 16)
    assert engine.kv_manager.pool.num_used == 0
    alone = [llm.generate(PROMPT, SamplingParams(temperature=0.8, seed=11 + i, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
             for i in range(n)]
    assert [c.token_ids for c in out.outputs] == [a.outputs[0].token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_n_completions_stream_and_abort_together(smollm2):
    engine = smollm2.engine
    request = engine.add_request(PROMPT, SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        outs = engine.step()
    assert len(outs) == 1 and all(len(c.new_token_ids) == 1 for c in outs[0].outputs)
    assert all(c.text.endswith(c.new_text) for c in outs[0].outputs)
    engine.abort_request(request)
    assert not engine.has_unfinished_requests() and engine.kv_manager.pool.num_used == 0


def test_an_interrupted_generate_leaves_no_request_behind(tiny_model_dir, monkeypatch):
    """Ctrl-C in a notebook mid-generate: its requests held their blocks and ran on in the next call."""
    llm = LLM(str(tiny_model_dir), num_blocks=32)
    step, calls = llm.engine.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2, 3], [4, 5]], SamplingParams(n=2, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv_manager.pool.num_used == 0
    out = llm.generate([[6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out) == 1 and len(calls) == 3 + 4  # the next call ran its own request's steps alone


def test_streams_read_in_turns_and_beside_generate(tiny_model_dir):
    """Each stream stepped the engine and kept only its own outputs: two streams read in turns lost each other's (the
    other then waited forever for its last), as did a stream left open across a generate, which also ran it on."""
    llm = LLM(str(tiny_model_dir), num_blocks=64)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids for ids in ([1, 2, 3], [4, 5])]
    first, second = llm.stream([1, 2, 3], params), llm.stream([4, 5], params)
    turns = [(a, b) for a, b in zip(first, second)]  # zip stops after the shorter: both yield 12 outputs here
    assert len(turns) == 12 and turns[-1][0].finished and turns[-1][1].finished
    assert [turns[-1][0].outputs[0].token_ids, turns[-1][1].outputs[0].token_ids] == alone
    assert [len(a.outputs[0].new_token_ids) for a, _ in turns] == [1] * 12  # every step's output, none skipped
    assert not llm._outputs  # the second stream, suspended after its last output, keeps no queue

    left_open = llm.stream([1, 2, 3], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    shown = [next(left_open)]
    steps, step = [], llm.engine.step
    llm.engine.step = lambda: steps.append(1) or step()
    out = llm.generate([[4, 5]], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == alone[1] and len(steps) == 12  # its own steps, not the stream's 40
    # the stream's request decoded in those steps: one output waits for it with all 12 tokens (not 12 outputs, each
    # with its text and ids so far)
    (waiting,) = llm._outputs.values()
    assert len(waiting) == 1 and len(waiting[0].outputs[0].new_token_ids) == 12
    shown += list(left_open)
    assert len(shown) == 2 + 40 - 13
    assert shown[-1].finished and len(shown[-1].outputs[0].token_ids) == 40
    assert [t for o in shown for t in o.outputs[0].new_token_ids] == shown[-1].outputs[0].token_ids
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv_manager.pool.num_used == 0


def test_generate_from_several_threads_batches_them(tiny_model_dir):
    """Two threads' generate calls stepped the engine at once: KeyErrors and a ValueError from its state. They now
    take turns at each step, whose outputs go to each call's requests."""
    llm = LLM(str(tiny_model_dir), num_blocks=64, **FP32)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    got, errors, sizes, step = {}, [], [], llm.engine.step
    llm.engine.step = lambda: sizes.append(len(llm.engine.requests)) or step()

    def run(i: int) -> None:
        try:
            got[i] = [llm.generate([prompts[i]], params, use_tqdm=False)[0].outputs[0].token_ids for _ in range(3)]
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(got[i] == [alone[i]] * 3 for i in range(len(prompts)))
    assert max(sizes) > 1  # some steps ran several threads' requests together
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv_manager.pool.num_used == 0


@pytest.mark.parametrize("options", [{}, {"speculative": "ngram"}, {"kv_policy": "h2o"}, {"kv_tiers": ["cpu:64MiB"]}])
def test_a_dropped_llm_frees_its_engine_at_once(tiny_model_dir, options):
    """The output processor held the engine's bound method: the engine, its KV pool and weights (1.1 GB for SmolLM2)
    stayed until the garbage collector found the cycle, so `llm = LLM(...)` run again in a notebook held two."""
    gc.collect()
    gc.disable()
    try:
        llm = LLM(str(tiny_model_dir), num_blocks=32, **options)
        llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
        engine = weakref.ref(llm.engine)
        del llm
        assert engine() is None
    finally:
        gc.enable()


def test_static_baseline_rejects_n(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), scheduler="static")
    with pytest.raises(KVServeError, match="one completion per request"):
        llm.generate([1, 2, 3], SamplingParams(n=2, max_tokens=2))


def test_streamed_text_is_transformers_decode(smollm2):
    """Streamed text comes from the tokenizers backend's decode (faster than transformers'), so it must be what
    transformers' decode gives: on SmolLM2's output, and on a tokenizer whose spaces transformers cleans up, which
    keeps transformers' decode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvserve.engine.detokenizer import IncrementalDetokenizer, SerialTokenizer

    out = smollm2.generate("Écris un poème: ", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    hf = smollm2.engine.checkpoint.tokenizer
    assert out.outputs[0].text == hf.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    words = Tokenizer(models.WordPiece({w: i for i, w in enumerate(["[UNK]", "hello", "world", ",", "!"])}, unk_token="[UNK]"))
    words.pre_tokenizer, words.decoder = pre_tokenizers.BertPreTokenizer(), decoders.WordPiece(cleanup=False)
    cleaned = PreTrainedTokenizerFast(tokenizer_object=words, clean_up_tokenization_spaces=True)
    ids = cleaned.encode("hello, world!")
    assert words.decode(ids) == "hello , world !" and SerialTokenizer(cleaned).decode_text(ids) == "hello, world!"
    streamed = IncrementalDetokenizer(SerialTokenizer(cleaned), ids[:1])
    assert "".join(streamed.push(i) for i in ids[1:]) == ", world!"
