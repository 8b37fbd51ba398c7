"""A random-weight Llama of SmolLM2-135M's shape saved as a Hugging Face directory (config.json + safetensors):
the model the GPU figures in the README were measured on, where the real GGUF file could not be carried.

    python bench/random_model.py DIR && python bench/throughput.py --model DIR
"""
from __future__ import annotations

import argparse

import torch
import transformers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory to write")
    args = parser.parse_args()
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                                      rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                                      eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"saved a random {params / 1e6:.0f}M-parameter Llama of SmolLM2-135M's shape to {args.out}")


if __name__ == "__main__":
    main()
