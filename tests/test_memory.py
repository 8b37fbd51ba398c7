"""The KV planner reproduces published figures, reads real configs, and rejects bad input clearly."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvserve import KVServeError
from kvserve.entrypoints import cli
from kvserve.memory import PlanRequest, DEVICES, capacity, kv_bytes, kv_bytes_per_token, load_spec, mha_factor, plan
from kvserve.memory.planner import kv_layout, roofline

GiB, KiB, MiB = 2**30, 2**10, 2**20


def test_llama_31_405b():
    spec = load_spec("llama-3.1-405b")
    assert kv_bytes_per_token(spec) == 1_032_192 == 1008 * KiB
    assert kv_bytes(spec, 131_072) == 126 * GiB
    assert mha_factor(spec) == 8
    assert kv_bytes_per_token(replace(spec, num_kv_heads=128)) == 8 * 1_032_192


def test_llama_3_70b_and_8b():
    spec = load_spec("llama-3-70b")
    assert kv_bytes_per_token(spec) == 327_680
    assert [round(kv_bytes(spec, n) / GiB, 1) for n in (8_000, 32_000, 128_000)] == [2.4, 9.8, 39.1]
    assert kv_bytes_per_token(load_spec("llama-3-8b")) == 128 * KiB


def test_llama_2_and_mistral():
    assert kv_bytes_per_token(load_spec("llama-2-7b")) == 0.5 * MiB
    assert kv_bytes(load_spec("llama-2-7b"), 4096) == 2 * GiB
    assert kv_bytes_per_token(load_spec("mistral-7b")) == 0.125 * MiB
    assert kv_bytes(load_spec("llama-2-13b"), 4096, batch=1) == 3_355_443_200


def test_deepseek_v3_mla():
    spec = load_spec("deepseek-v3")
    assert kv_bytes_per_token(spec) == 70_272
    gqa16 = replace(spec, kv_lora_rank=0, qk_rope_head_dim=0, num_kv_heads=16, head_dim=128)
    assert 6.5 < kv_bytes_per_token(gqa16) / kv_bytes_per_token(spec) < 7.5
    assert spec.num_params() == pytest.approx(671e9, rel=0.01)
    assert spec.active_params() == pytest.approx(37e9, rel=0.03)  # DeepSeek's published activated parameters


def test_sliding_window_layers_hold_at_most_their_window():
    spec = load_spec("gemma-3-270m")  # 18 layers, 15 local with a 512-token window, MQA, head_dim 256
    per_layer = 2 * 1 * 256 * 2
    assert kv_bytes(spec, 100) == 18 * 100 * per_layer
    assert kv_bytes(spec, 32_768) == (3 * 32_768 + 15 * 512) * per_layer


def test_quantized_dtypes_count_their_scales():
    spec = load_spec("llama-3-8b")  # 8 KV heads x 128 = 1024 values of K and of V per layer per token, 32 groups of 32
    assert kv_bytes_per_token(spec, "fp8") == 32 * 2048
    assert kv_bytes_per_token(spec, "int8") == 32 * (2048 + 2 * 32 * 2)  # one fp16 scale per group
    assert kv_bytes_per_token(spec, "int4") == 32 * (1024 + 2 * 32 * 4)  # fp16 scale and minimum per group
    # kivi2: K per channel (scale and minimum per 16-token block), V per token like int4
    assert kv_bytes_per_token(spec, "kivi2") == 32 * ((256 + 1024 * 4 / 16) + (256 + 32 * 4))
    assert kv_bytes_per_token(spec, "int8/int4") == 32 * ((1024 + 32 * 2) + (512 + 32 * 4))  # K and V apart


def test_quantized_pools_hold_more_tokens_than_fp32():
    """The issue's targets: at the same bytes, int8 >= 3.5x, int4 >= 6x and kivi2 >= 9x the tokens of fp32."""
    spec = load_spec("smollm2-135m")
    fp32 = kv_bytes_per_token(spec, "fp32")
    ratios = {name: fp32 / kv_bytes_per_token(spec, name) for name in ("int8", "int4", "kivi2")}
    assert ratios["int8"] >= 3.5 and ratios["int4"] >= 6 and ratios["kivi2"] >= 9, ratios


def test_kivi2_holds_its_newest_tokens_in_full_precision():
    spec = load_spec("llama-3-8b")
    packed, full = kv_bytes_per_token(spec, "kivi2"), kv_bytes_per_token(spec, "bf16")
    assert kv_bytes(spec, 100, dtype="kivi2") == 100 * full
    assert kv_bytes(spec, 10_000, dtype="kivi2") == 128 * full + (10_000 - 128) * packed


def test_llama_3_70b_by_kv_dtype_before_scales():
    spec = load_spec("llama-3-70b")
    bits = {name: kv_layout(spec, name).k_format.bits for name in ("bf16", "int8", "int4", "kivi2")}
    assert {n: round(kv_bytes(spec, 32_000) * b / 16 / GiB, 1) for n, b in bits.items()} == \
        {"bf16": 9.8, "int8": 4.9, "int4": 2.4, "kivi2": 1.2}
    # with scales (and kivi2's 128 bf16 tokens): int8 +1/16, int4 +1/4, kivi2 keys +1, values +1/2 per 2 bits
    assert {n: round(kv_bytes(spec, 32_000, dtype=n) / GiB, 2) for n in bits} == \
        {"bf16": 9.77, "int8": 5.19, "int4": 3.05, "kivi2": 2.17}


def test_llama_3_70b_requests_in_400_gib_of_kv():
    cap = capacity(load_spec("llama-3-70b"), 400 * GiB, [2_000, 128_000], weight_bytes=0, utilization=1.0)
    assert cap.max_requests == {2_000: 655, 128_000: 10}


def test_capacity_on_devices():
    spec = load_spec("llama-3-8b")
    cap = capacity(spec, 80 * 10**9, [8192], "bf16", utilization=0.9)
    assert cap.weight_bytes == spec.num_params() * 2 and spec.num_params() == pytest.approx(8.03e9, rel=0.01)
    assert cap.max_requests[8192] == int((72 * 10**9 - cap.weight_bytes) // (8192 * 128 * KiB))
    huge = capacity(load_spec("llama-3.1-405b"), 80 * 10**9, [4096])
    assert huge.kv_budget < 0 and huge.max_requests[4096] == 0


def test_h100_balance_batch1_decode_memory_bound_2048_prefill_compute_bound():
    h100 = DEVICES["h100-80gb"]
    assert h100.flops / h100.bandwidth == pytest.approx(295, abs=1)
    prefill, _ = roofline(load_spec("llama-3-8b"), batch=1, context=2048)
    _, decode = roofline(load_spec("llama-3-8b"), batch=1, context=2048)
    assert prefill.bound(h100) == "compute" and decode.bound(h100) == "memory"


def test_roofline_decode_memory_bound_prefill_compute_bound():
    report = plan(load_spec("llama-3-70b"), DEVICES["h100-80gb"], PlanRequest(batches=[1], contexts=[4096], num_devices=8))
    r = report["roofline"]
    assert r["decode"]["bound"] == "memory" and r["prefill"]["bound"] == "compute"
    weights = load_spec("llama-3-70b").num_params() * 2
    assert r["decode_tokens_per_s_bound"] < 8 * 3.35e12 / weights


def test_reads_hf_config_gguf_and_builtin(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256,
                                                      "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000}))
    assert kv_bytes_per_token(load_spec(str(tmp_path))) == 2 * 4 * 2 * 32 * 2
    smol = load_spec("smollm2-135m")  # the GGUF file's metadata
    assert (smol.num_layers, smol.num_heads, smol.num_kv_heads, smol.head_dim) == (30, 9, 3, 64)
    assert kv_bytes_per_token(smol, "fp32") == 2 * 30 * 3 * 64 * 4


def test_engine_sizes_its_pool_with_the_planner(tiny_model_dir):
    from kvserve import LLM

    llm = LLM(str(tiny_model_dir), kv_cache_memory="1MiB", block_size=8, kv_cache_dtype="float32")
    per_token = kv_bytes_per_token(load_spec(str(tiny_model_dir)), "fp32")
    assert llm.engine.kv_manager.num_blocks == MiB // (8 * per_token)


def test_pool_as_a_share_of_the_memory_free_after_loading(tiny_model_dir, monkeypatch):
    from kvserve import LLM
    from kvserve.kv import cache

    seen = []
    monkeypatch.setattr(cache, "free_memory", lambda device: seen.append(device.type) or 10 * MiB)
    per_token = kv_bytes_per_token(load_spec(str(tiny_model_dir)), "fp32")
    llm = LLM(str(tiny_model_dir), kv_cache_memory="5%", block_size=8, kv_cache_dtype="float32", device="cpu")
    assert set(seen) == {"cpu"} and llm.engine.kv_manager.num_blocks == int(0.05 * 10 * MiB) // (8 * per_token)
    assert llm.engine.kv_usage()["total_bytes"] <= 0.05 * 10 * MiB
    # no more blocks than max_num_seqs requests of max_model_len tokens fill
    capped = LLM(str(tiny_model_dir), kv_cache_memory="100%", block_size=8, max_num_seqs=3, max_model_len=100, device="cpu")
    assert capped.engine.kv_manager.num_blocks == 3 * 13
    assert "KV pool up to 100% of the memory free after loading" in cli.startup_note(capped.engine)
    sized = LLM(str(tiny_model_dir), kv_cache_memory="1MiB")
    assert "of the memory free" not in cli.startup_note(sized.engine)


def test_free_memory_reads_the_device():
    import torch

    from kvserve.kv.cache import free_memory

    assert 0 < free_memory(torch.device("cpu")) < 2**50


@pytest.mark.parametrize("value,message", [("0%", "in \\(0%, 100%\\]"), ("150%", "got '150%'"), ("half%", "invalid share 'half%'"),
                                           ("0", "must be a positive size"), ("lots", "invalid size 'lots'")])
def test_bad_kv_cache_memory(tiny_model_dir, value, message):
    from kvserve import LLM

    with pytest.raises(KVServeError, match=message):
        LLM(str(tiny_model_dir), kv_cache_memory=value)
    assert cli.main(["generate", "--model", str(tiny_model_dir), "--kv-cache-memory", value, "--prompt", "hi"]) == 2


@pytest.mark.parametrize("option", [dict(num_blocks=10**12), dict(kv_cache_memory="100TiB")])
def test_a_pool_larger_than_free_memory_is_refused(tiny_model_dir, option):
    """The pool's map failed with an OSError (ENOMEM), or, a little under the kernel's limit, succeeded until its
    pages filled."""
    from kvserve import LLM

    with pytest.raises(KVServeError, match=r"a KV pool of \d+ blocks needs [\d.]+ GiB, but [\d.]+ GiB of cpu memory is free"):
        LLM(str(tiny_model_dir), **option)


@pytest.mark.parametrize("source,message", [("no-such-model", "is not a preset"), ("bad.json", "cannot read"),
                                            ("empty.json", "the config of empty.json: vocab_size must be a positive integer, got None")])
def test_bad_configs(tmp_path, monkeypatch, source, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(KVServeError, match=message):
        load_spec(source)


def test_cli_json_table_and_plot(tmp_path, capsys):
    assert cli.main(["memory", "llama-3-70b", "--json", "--contexts", "8000", "--batch", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kv"]["bf16"]["bytes_per_token"] == 327_680
    assert cli.main(["memory", "mistral-7b", "--device", "a100-80gb", "--plot", str(tmp_path / "kv.png")]) == 0
    assert "Roofline" in capsys.readouterr().out and (tmp_path / "kv.png").stat().st_size > 1000
    assert cli.main(["memory", "mistral-7b", "--kv-dtype", "int3"]) == 2
    assert "unknown KV dtype 'int3'" in capsys.readouterr().err
    assert cli.main(["memory", "llama-3-8b", "--json", "--kv-dtype", "int8/int4", "--kv-dtype", "kivi2"]) == 0
    kv = json.loads(capsys.readouterr().out)["kv"]
    assert kv["int8/int4"]["bytes_per_token"] == 32 * ((1024 + 32 * 2) + (512 + 32 * 4)) and "kivi2" in kv
    assert cli.main(["memory", "mistral-7b", "--device", "tpu"]) == 2


def test_cli_takes_the_model_first_or_as_model(capsys):
    """`kvserve memory` took its model only as the first argument and the engine commands only as --model (`kvserve serve
    MODEL`, as vLLM's, was an unrecognized argument), as were eval and distill: each takes either, once, and the engine
    commands default to SmolLM2."""
    assert cli.main(["memory", "llama-3-70b", "--json"]) == 0
    first = capsys.readouterr().out
    assert cli.main(["memory", "--model", "llama-3-70b", "--json"]) == 0 and capsys.readouterr().out == first
    assert cli.main(["memory"]) == 2 and "kvserve memory needs a model" in capsys.readouterr().err
    assert cli.main(["memory", "llama-3-70b", "--model", "mistral-7b"]) == 2
    assert "the model is given twice: 'llama-3-70b' and --model 'mistral-7b'" in capsys.readouterr().err
    for argv, model in ((["serve", "my-model"], "my-model"), (["serve", "--model", "m", "--port", "1"], "m"), (["serve"], "smollm2-135m"),
                        (["generate", "--prompt", "hi", "m"], "m"), (["chat", "m", "--model", "m"], "m"), (["eval", "m"], "m"),
                        (["eval"], "smollm2-135m"), (["distill", "m", "--steps", "2"], "m"), (["distill", "--model", "m"], "m"),
                        (["distill"], "smollm2-135m")):
        args = cli.build_parser().parse_args(argv)
        cli.check_args(args)
        assert args.model == model and "model_arg" not in args
    assert cli.main(["distill", "a", "--model", "b"]) == 2 and "given twice: 'a' and --model 'b'" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [(["--memory", "0"], "memory must be > 0, got 0"),  # was the device's memory
                                          (["--kv-dtype", "int8/"], "unknown KV dtype ''"),  # was int8 for both
                                          (["--flops", "inf"], "finite FLOP/s"), (["--bandwidth", "nan"], "finite FLOP/s")])
def test_cli_memory_refuses_values_it_used_to_replace_or_take(capsys, args, message):
    assert cli.main(["memory", "mistral-7b", *args]) == 2
    assert message in capsys.readouterr().err


def test_planner_matches_what_the_engine_allocates_for_smollm2(smollm2):
    cache = smollm2.engine.runner.kv_cache
    allocated_per_token = cache.nbytes / (cache.num_blocks * cache.block_size)
    assert allocated_per_token == kv_bytes_per_token(load_spec("smollm2-135m"), "fp32") == 2 * 30 * 3 * 64 * 4


@pytest.mark.parametrize("dtype", ["int8", "int4", "fp8_e4m3", "int8/int4"])
def test_planner_matches_the_engines_quantized_pool(tiny_model_dir_d32, dtype):
    from kvserve import LLM

    k, _, v = dtype.partition("/")
    llm = LLM(str(tiny_model_dir_d32), kv_cache_memory="1MiB", block_size=8, cache_type_k=k, cache_type_v=v or k)
    cache, planned = llm.engine.runner.kv_cache, kv_bytes_per_token(load_spec(str(tiny_model_dir_d32)), dtype)
    assert cache.nbytes == cache.num_blocks * 8 * planned
    assert cache.num_blocks == MiB // (8 * planned)


def test_layout_groups_layers_of_equal_specs_in_equal_sizes():
    from kvserve.kv.spec import group_layers, layer_specs

    gemma = kv_layout(load_spec("gemma-3-270m"))  # 15 sliding-window layers, 3 global: groups of 3 share tensors
    assert [(g.spec.kind, g.layers) for g in gemma.groups] == [
        ("sliding", (0, 1, 2)), ("sliding", (3, 4, 6)), ("sliding", (7, 8, 9)), ("sliding", (10, 12, 13)),
        ("sliding", (14, 15, 16)), ("full", (5, 11, 17))]
    assert gemma.bytes_per_token == 18 * 2 * 256 * 2  # while every layer still holds the token
    assert kv_bytes(load_spec("gemma-3-270m"), 32_768) == gemma.bytes_held(32_768) == (3 * 32_768 + 15 * 512) * 2 * 256 * 2
    mla = kv_layout(load_spec("deepseek-v3"))
    assert [g.spec for g in mla.groups][0].kind == "latent" and len(mla.groups) == 1 and mla.bytes_per_token == 70_272
    assert len(group_layers(layer_specs(load_spec("llama-3-8b")))) == 1


def test_plans_kv_policy_budgets():
    """Llama 3 8B at 128 KiB/token in bf16: a policy's request holds its kept tokens only."""
    spec = load_spec("llama-3-8b")
    report = plan(spec, DEVICES["h100-80gb"], PlanRequest(dtypes=["bf16"], contexts=[4096, 32768],
                                                          policies=["streaming:sinks=4,window=1024", "h2o:budget=0.2"]))
    streaming, h2o = report["policies"]["streaming:sinks=4,window=1024"], report["policies"]["h2o:budget=0.2,recent=0.5"]
    assert streaming["held_tokens"] == {4096: 1028, 32768: 1028} and streaming["bytes_per_request"][32768] == 1028 * 128 * KiB
    assert h2o["held_tokens"] == {4096: 820, 32768: 6554}
    budget = report["capacity"]["kv_budget_bytes"]["bf16"]
    assert h2o["max_requests"][32768] == budget // (6554 * 128 * KiB) > report["capacity"]["max_requests"]["bf16"][32768]
    with pytest.raises(KVServeError, match="unknown kv_policy"):
        plan(spec, DEVICES["h100-80gb"], PlanRequest(policies=["lru:budget=3"]))


def test_plans_minicache_bytes():
    """Llama 3 8B from layer 16: 8 merged pairs, each block of a pair's K or V holding 16 directions (8 heads x 128
    bf16), two layers' fp16 magnitudes, 2 retained tokens a head and their int16 offsets."""
    report = plan(load_spec("llama-3-8b"), DEVICES["h100-80gb"], PlanRequest(dtypes=["bf16"], contexts=[4096],
                                                                          policies=["minicache:start=16"]))
    merged = report["policies"]["minicache:start=16,t=0.6,threshold=0.25,retain=2"]
    pair_block = 16 * 8 * 128 * 2 + 16 * 2 * 8 * 2 + 2 * 8 * 128 * 2 + 2 * 8 * 2
    per_token = 16 * 128 * KiB // 32 + 8 * 2 * pair_block // 16
    assert merged["held_tokens"] == {4096: 4096} and merged["bytes_per_request"][4096] == 4096 * per_token
    assert 0.78 < per_token / (128 * KiB) < 0.79
