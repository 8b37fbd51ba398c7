"""`kvserve eval` on a tiny budget: it runs end to end, measures the model (its baseline perplexity is
transformers'), finds the passkey, and shows a deliberately broken KV option as broken."""
from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch

from kvserve import KVServeError
from kvserve.entrypoints import cli
from kvserve.eval import EvalSettings, parse_options, run_eval
from kvserve.eval.passkey import passkey_prompts
from kvserve.eval.text import load_text
from kvserve.kv.formats import FORMATS
from kvserve.kv.formats.int8 import Int8Format

CONTEXT, TOKENS = 256, 512
SMALL_POOL = "matmul_dtype=float32,kv_cache_memory=32MiB"  # 720 tokens: a default pool is zeroed for seconds


class SignFormat(Int8Format):
    """A deliberately broken KV dtype: one bit per value (its sign) times the group's mean magnitude."""

    name = "sign1"

    def quantize_tokens(self, x):
        g = x.float().unflatten(-1, (-1, self.group))
        return {"data": g.sign().to(torch.int8).flatten(-2), "scale": g.abs().mean(-1).half()}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setitem(FORMATS, "sign1", (SignFormat(), SignFormat()))
    patch.setattr("kvserve.config.KV_CACHE_DTYPES", (*cli.KV_CACHE_DTYPES, "sign1"))
    out = tmp_path_factory.mktemp("eval")
    argv = ["eval", "--compare", "kv_cache_dtype=int8", "--compare", "kv_cache_dtype=sign1", "--context", str(CONTEXT),
            "--base", SMALL_POOL,
            "--tokens", str(TOKENS), "--chunk", "64", "--passkey-lengths", "256", "--passkey-depths", "0,50",
            "--decode-tokens", "8", "--json", "--plot", str(out)]
    stdout = io.StringIO()  # capsys is per test; this fixture serves the module
    with contextlib.redirect_stdout(stdout):
        assert cli.main(argv) == 0
    patch.undo()
    return json.loads(stdout.getvalue()), out


def test_runs_end_to_end_and_writes_json_and_plots(report):
    data, out = report
    names = [r["name"] for r in data["results"]]
    assert names == ["baseline", "kv_cache_dtype=int8", "kv_cache_dtype=sign1"]
    assert data["scored_tokens"] == 2 * (CONTEXT - 1)
    for r in data["results"]:
        assert set(r) >= {"perplexity", "delta_ppl", "kl_mean", "top1_agreement", "passkey", "passkey_accuracy",
                          "kv_bytes_per_token", "tokens_per_gib", "decode_tok_s"}
    assert (out / "perplexity.png").stat().st_size > 1000 and (out / "passkey.png").stat().st_size > 1000


def test_int8_is_close_and_a_broken_option_is_not(report):
    base, int8, broken = report[0]["results"]
    assert base["kl_mean"] == 0 and base["top1_agreement"] == 1
    assert abs(int8["delta_ppl"]) < 0.01 and int8["kl_mean"] < 1e-2 and int8["top1_agreement"] > 0.95
    assert broken["perplexity"] > 2 * base["perplexity"] and broken["kl_mean"] > 0.5 and broken["top1_agreement"] < 0.7


def test_full_precision_baseline_finds_the_passkey(report):
    base = report[0]["results"][0]
    assert base["passkey"] == {"256": {"0": 1.0, "50": 1.0}}


def test_baseline_perplexity_is_transformers(report, smollm2, hf_smollm2):
    """The harness measures the model, not itself: the same windows through transformers, in fp32."""
    hf = hf_smollm2
    ids = smollm2.engine.tokenize(load_text(None))
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, TOKENS - CONTEXT + 1, CONTEXT):
            window = torch.tensor([ids[start:start + CONTEXT]])
            logprobs = torch.log_softmax(hf(window).logits[0, :-1], dim=-1)
            nll -= float(logprobs.gather(1, window[0, 1:, None]).sum())
            count += CONTEXT - 1
    assert report[0]["results"][0]["perplexity"] == pytest.approx(math.exp(nll / count), rel=0.005)


def test_passkey_prompts_are_deterministic_and_fit(smollm2):
    a = passkey_prompts(smollm2.engine, [256, 512], [0, 100], 2, seed=3)
    b = passkey_prompts(smollm2.engine, [256, 512], [0, 100], 2, seed=3)
    assert [p.key for p in a] == [p.key for p in b] and len({p.key for p in a}) > 1
    assert all(len(p.token_ids) <= p.length and p.key in smollm2.tokenizer.decode(p.token_ids) for p in a)


@pytest.mark.parametrize("options,message", [
    ("kv_cache_dtyp=int8", "unknown engine option 'kv_cache_dtyp'"),
    ("kv_cache_dtype", "option 'kv_cache_dtype' is not name=value"),
    ("block_size=big", "option block_size takes an integer, got 'big'"),
])
def test_bad_options(options, message):
    with pytest.raises(KVServeError, match=message):
        parse_options(options)


def test_policy_options_keep_their_commas():
    assert parse_options("matmul_dtype=float32,kv_policy=streaming:sinks=4,window=64,block_size=8") == {
        "matmul_dtype": "float32", "kv_policy": "streaming:sinks=4,window=64", "block_size": 8}
    with pytest.raises(KVServeError, match="option 'window=64' is not|unknown engine option 'window'"):
        parse_options("block_size=8,window=64")


def test_bad_values_text_and_context(tmp_path):
    with pytest.raises(KVServeError, match="kv_cache_dtype must be one of .* got 'int3'"):
        run_eval(EvalSettings(compare=["kv_cache_dtype=int3"], base="kv_cache_dtype=int3"), progress=False)
    short = tmp_path / "short.txt"
    short.write_text("Too short to fill a window.")
    with pytest.raises(KVServeError, match=r"(\d+) tokens to score \(--tokens 8192; the text has \1\) hold no window of --context 2048"):
        run_eval(EvalSettings(text=str(short)), progress=False)
    with pytest.raises(KVServeError, match=r"100 tokens to score \(--tokens 100; the text has \d+\) hold no window of --context 2048"):
        run_eval(EvalSettings(tokens=100), progress=False)
    with pytest.raises(KVServeError, match="context 9000 is longer than the model's window of 8192 tokens"):
        run_eval(EvalSettings(context=9000), progress=False)


@pytest.mark.parametrize("compare,message", [
    ("kv_cache_dtype=int3", "kv_cache_dtype must be one of .* got 'int3'"),
    ("kv_policy=streaming:sinks=4,window=8", r"kv_policy streaming: the window \(8\) is smaller than a block \(16 tokens\)"),
    ("speculative=ngram:k=99", "speculative decoding needs 1 <= k <= 16"),
])
def test_every_option_set_is_checked_before_the_baseline_runs(monkeypatch, compare, message):
    """A typo in the last --compare failed after the baseline's minutes of work."""
    import kvserve.eval as evaluation

    monkeypatch.setattr(evaluation, "_engine", lambda *a: pytest.fail("an engine was built before the options were checked"))
    with pytest.raises(KVServeError, match=message):
        run_eval(EvalSettings(compare=["kv_cache_dtype=int8", compare]), progress=False)


def test_decode_tokens_must_leave_a_prompt():
    """With --decode-tokens >= --context the decode-speed prompt was empty: an IndexError after the scoring."""
    with pytest.raises(KVServeError, match="--decode-tokens 32 must be below --context 32"):
        run_eval(EvalSettings(context=32), progress=False)
