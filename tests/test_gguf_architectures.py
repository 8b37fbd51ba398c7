"""GGUF files of each architecture, written here from tiny random transformers models the way llama.cpp's
converter writes them (Llama's q/k rows permuted, Llama 3.1's rope_freqs, Gemma's norms stored as 1 + w), load
into kvserve with the transformers model's logits."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvserve import LLM, KVServeError
from kvserve.models.gguf_convert import _GEMMA3_NAMES, _GLOBAL_NAMES, _LAYER_NAMES, copy_without_tokenizer
from kvserve.models.loader import transformers_model
from tests.conftest import FP32, save_tiny

LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16, "rope_theta": 10000.0}
CASES = {
    "llama-3.1-rope-freqs": ("llama", "llama", dict(rope_parameters=LLAMA31_ROPE)),
    "qwen2": ("qwen2", "qwen2", {}),
    "qwen3": ("qwen3", "qwen3", dict(head_dim=16)),
    "gemma3": ("gemma3", "gemma3_text", dict(num_hidden_layers=6, head_dim=16, sliding_window=12, query_pre_attn_scalar=16,
                                              num_key_value_heads=1)),
}


def write_gguf(path, arch: str, hf, qtype: str = "F32") -> None:
    """qtype: the type of every 2-D weight (see round_weights)."""
    import gguf

    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters.get("full_attention", cfg.rope_parameters)["rope_theta"])
    writer.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    writer.add_token_scores([0.0] * cfg.vocab_size)
    writer.add_bos_token_id(1)
    if arch == "gemma3":
        writer.add_sliding_window(cfg.sliding_window)
    names = {v: k for k, v in (_GEMMA3_NAMES if arch == "gemma3" else _LAYER_NAMES).items()}
    for name, tensor in hf.state_dict().items():
        array = tensor.float().numpy()
        if name.startswith("model.layers."):
            _, _, i, *rest = name.split(".")
            gguf_name = f"blk.{i}.{names['.'.join(rest[:-1])]}.{rest[-1]}"
        else:
            gguf_name = f"{next(k for k, v in _GLOBAL_NAMES.items() if name.startswith(v))}.weight"
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            array = array.reshape(heads, 2, array.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(array.shape)
        if arch == "gemma3" and "norm" in name:
            array = array + 1
        if qtype != "F32" and array.ndim == 2:
            array = gguf.quants.quantize(array, gguf.GGMLQuantizationType[qtype])
        if gguf_name != "output.weight" or not cfg.tie_word_embeddings:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array), raw_dtype=None if qtype == "F32" or array.dtype != np.uint8
                              else gguf.GGMLQuantizationType[qtype])
    if arch == "llama":  # llama.cpp's converter writes the llama3 scaling as one divisor per frequency
        default = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        writer.add_tensor("rope_freqs.weight", (default / hf.model.rotary_emb.inv_freq).numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def round_weights(hf, qtype: str) -> None:
    """Every 2-D weight of the transformers model set to the values its blocks of `qtype` hold (quantizing them again
    gives the same blocks: the file then holds exactly these values)."""
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    with torch.no_grad():
        for tensor in hf.state_dict().values():
            if tensor.dim() == 2:
                tensor.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(tensor.float().numpy(), t), t)))


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q5_0"])
@pytest.mark.parametrize("case", CASES)
def test_gguf_file_loads_with_the_transformers_logits(tmp_path, monkeypatch, case, qtype):
    """Float files, and files of quantized weights (packed for the kernels; every architecture's decode steps run as
    the fused layer ops: Qwen3's and Gemma 3's q/k norms, Gemma's norms over the attention's and MLP's outputs and its
    GELU-tanh, its sliding window of 12 inside the 40-token prompt)."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    arch, model_type, overrides = CASES[case]
    hf = save_tiny(tmp_path / "hf", model_type, **overrides)
    if qtype != "F32":
        round_weights(hf, qtype)
    write_gguf(tmp_path / "tiny.gguf", arch, hf, qtype)
    llm = LLM(str(tmp_path / "tiny.gguf"), kv_cache_memory="4MiB", block_size=4, **FP32)
    assert llm.engine.checkpoint.config.model_type == model_type
    import gguf.gguf_reader

    assert gguf.gguf_reader.np is np  # the conversion lent the reader plain arrays, and gave numpy back
    if qtype != "F32" and llm.engine.runner.native:  # CUDA dequantizes the file's weights once
        model = llm.engine.runner.model
        assert model.embed_tokens.qweight.types == [qtype]
        assert all(layer.fused is not None for layer in model.layers) and llm.engine.runner.backend.stack is not None
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    out = llm.generate([prompt], _greedy_with_logprobs(8), use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        expected = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    assert out.token_ids == expected.argmax(-1).tolist()
    chosen = [lp.logprob for lp in out.logprobs]
    assert chosen == pytest.approx(expected.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0].tolist(), abs=1e-4)
    if arch == "llama":  # the factors matter: without them the logits differ
        assert not math.isclose(float(hf.model.rotary_emb.inv_freq[-1]), 1e4 ** (-(hf.config.head_dim - 2) / hf.config.head_dim))


@pytest.mark.parametrize("case", ["gemma3", "llama-3.1-rope-freqs"])
def test_a_copy_without_the_tokenizers_arrays_keeps_the_rest(tmp_path, case):
    """What transformers reads as the reference (a GGUF's tokenizer arrays would cost it seconds): every tensor and
    every other entry as they were, the vocabulary's size as an entry; transformers' model of it is the file's."""
    import gguf

    arch, model_type, overrides = CASES[case]
    hf = save_tiny(tmp_path / "hf", model_type, **overrides)
    round_weights(hf, "Q8_0")
    write_gguf(tmp_path / "full.gguf", arch, hf, "Q8_0")
    copy_without_tokenizer(tmp_path / "full.gguf", tmp_path / "light.gguf")
    full, light = gguf.GGUFReader(tmp_path / "full.gguf"), gguf.GGUFReader(tmp_path / "light.gguf")
    dropped = {"tokenizer.ggml.tokens", "tokenizer.ggml.scores"}
    assert set(light.fields) == set(full.fields) - dropped | {f"{arch}.vocab_size"}
    assert light.fields[f"{arch}.vocab_size"].contents() == hf.config.vocab_size
    kept = {k for k in full.fields if k not in dropped and k != "GGUF.kv_count"}  # the reader lists the header too
    assert all(light.fields[k].contents() == full.fields[k].contents() for k in kept)
    assert light.fields["tokenizer.ggml.bos_token_id"].contents() == 1
    assert [(t.name, t.tensor_type, t.data.tobytes()) for t in light.tensors] == [
        (t.name, t.tensor_type, t.data.tobytes()) for t in full.tensors]
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(40))
    with pytest.raises(KVServeError, match="not a GGUF file of version 2 or later"):
        copy_without_tokenizer(tmp_path / "not.gguf", tmp_path / "out.gguf")
    from transformers import AutoModelForCausalLM

    direct = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="full.gguf")
    via_copy = transformers_model(tmp_path / "full.gguf")
    assert via_copy.config.vocab_size == direct.config.vocab_size == hf.config.vocab_size
    prompt = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(via_copy(prompt).logits, direct(prompt).logits, atol=0, rtol=0)


def _greedy_with_logprobs(n: int):
    from kvserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
