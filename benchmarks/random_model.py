"""A random-weight HF checkpoint at a real model's shapes, for speed checks where no checkpoint can be had.

Speed does not depend on the weight values (measured here: the lent GPU machine cannot receive a real
checkpoint), so a Qwen2-0.5B-shaped model with random weights and the tiny locally trained tokenizer
times every pass at the real shapes. Its vocabulary keeps the real size (151936 rows): ids the small
tokenizer does not know decode to nothing. A random model almost never samples eos among 151936 ids,
so every response runs to max_new_tokens: fixed generation lengths.

    python benchmarks/random_model.py --shape qwen2-0.5b --out /tmp/qwen2-0.5b-random
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Shapes from the models' published config.json files.
SHAPES = {
    "qwen2-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "qwen2-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # Qwen2's architecture (QKV bias, tied embeddings, GQA) at tiny shapes, for `gpu_check.sh --cpu`:
    # head_dim 32 as the CPU attention kernels need; the vocabulary just covers the tiny tokenizer.
    "qwen2-tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=2048,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}


def make_random_model(out_dir: str, shape: str, dtype_name: str = "bfloat16", seed: int = 0) -> str:
    """Write config, random safetensors and the tiny tokenizer to out_dir (once; safe across processes)."""
    from megatron_bridge.atomic import build_once

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: choose one of {', '.join(SHAPES)}")
    return build_once(out_dir, lambda tmp: _build(tmp, shape, dtype_name, seed))


def _build(out_dir: str, shape: str, dtype_name: str, seed: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_bridge.tiny import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer(out_dir)
    eos = tokenizer.eos_token_id
    config = Qwen2Config(
        **SHAPES[shape],
        use_sliding_window=False,
        eos_token_id=eos,
        pad_token_id=eos,
        bos_token_id=tokenizer.bos_token_id,
        torch_dtype=dtype_name,
    )
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # random init of 0.5B parameters: seconds on a GPU
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(getattr(torch, dtype_name))
    from megatron_bridge.atomic import save_pretrained_here

    save_pretrained_here(model, out_dir)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = p.parse_args(argv)
    print(make_random_model(args.out, args.shape, args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
