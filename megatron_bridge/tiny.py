"""Tiny HF checkpoints built locally: random weights, a tokenizer trained here, no download.

Tests and `yaml_configs/tiny_cpu.yaml` (`model.path: tiny`) use these. Llama, Qwen2 and Qwen3
variants exercise the bridge's layouts: GQA, tied or untied embeddings, QKV bias (Qwen2), q/k norms
and an explicit head_dim (Qwen3), Llama 3.x RoPE scaling, and a vocabulary that is not a multiple
of 128. head_dim is 32 by default because vLLM's CPU attention needs one of {32, 64, 80, ...}.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Optional

from megatron_bridge.atomic import build_once, save_pretrained_here
from megatron_bridge.errors import InputError

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as SmolLM2 and Qwen2 use.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOKENIZER_VOCAB = 300  # byte alphabet (256) + 3 specials + a few merges; not a multiple of 128


@dataclass
class TinySpec:
    """Shape of a tiny random-weight model (`model.path: tiny`; head_dim >= 32 for vLLM CPU attention)."""

    arch: str = "llama"  # llama | qwen2 | qwen3 | qwen3_moe
    hidden_size: int = 128
    num_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    tie_word_embeddings: bool = True
    seed: int = 0
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    # Optional fields: None leaves the checkpoint (and its cache key) as before they existed.
    head_dim: Optional[int] = None  # None: hidden / heads; Qwen3 fixtures set e.g. 64 with hidden 128 / 4 heads
    # e.g. {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    #       "original_max_position_embeddings": 64}
    rope_scaling: Optional[dict] = None
    # Qwen3-MoE (arch qwen3_moe): routed experts in every layer, top-k renormalised
    num_experts: Optional[int] = None
    num_experts_per_tok: Optional[int] = None
    moe_intermediate_size: Optional[int] = None


def _corpus() -> list[str]:
    words = (
        "What is plus minus times the answer Add Subtract Multiply and give after #### "
        "Tom has apples He buys more How many does now? Copy digit number final user assistant system"
    )
    lines = [words]
    for a in range(0, 60, 3):
        for b in range(0, 30, 4):
            lines.append(f"What is {a} plus {b}? {a} + {b} = {a + b}. #### {a + b}")
    return lines


def make_tiny_tokenizer(out_dir: str):
    """Train a byte-level BPE tokenizer (digits split one by one) and save it as HF files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        bos_token="<|im_start|>",
        unk_token=None,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out_dir)
    return hf_tok


def make_tiny_checkpoint(out_dir: str, spec: Optional[TinySpec] = None) -> str:
    """Write config.json, model.safetensors and tokenizer files of a random tiny model."""
    import torch

    spec = spec or TinySpec()
    tokenizer = make_tiny_tokenizer(out_dir)
    config = _hf_config(spec, vocab_size=len(tokenizer), eos_id=tokenizer.eos_token_id)
    model_cls = _model_class(spec.arch)
    torch.manual_seed(spec.seed)
    model = model_cls(config)
    _perturb(model, spec.seed)
    save_pretrained_here(model, out_dir)
    return out_dir


def make_tiny_reward_model(out_dir: str, spec: Optional[TinySpec] = None, score_scale: float = 1.0) -> str:
    """A random `LlamaForSequenceClassification` / `Qwen2ForSequenceClassification` (num_labels=1).

    The reward-model format of OpenRLHF, verl and TRL: decoder body plus `score.weight` [1, H], read
    at the last non-pad token (so pad_token_id is set). `score_scale` widens the random head so
    scores differ visibly between responses.
    """
    import torch
    from transformers import LlamaForSequenceClassification, Qwen2ForSequenceClassification

    spec = spec or TinySpec()
    tokenizer = make_tiny_tokenizer(out_dir)
    config = _hf_config(spec, vocab_size=len(tokenizer), eos_id=tokenizer.eos_token_id)
    config.num_labels = 1
    classes = {"llama": LlamaForSequenceClassification, "qwen2": Qwen2ForSequenceClassification}
    torch.manual_seed(spec.seed)
    model = classes[spec.arch](config)
    _perturb(model, spec.seed)
    with torch.no_grad():
        model.score.weight.mul_(score_scale)
    save_pretrained_here(model, out_dir)
    return out_dir


def ensure_tiny_reward_model(spec: Optional[TinySpec] = None, cache_dir: str | None = None) -> str:
    """The cached tiny reward model for `spec` (built once, like `ensure_tiny_checkpoint`)."""
    spec = spec or TinySpec()
    key = hashlib.sha1(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(cache_dir or default_cache_dir(), f"tiny-rm-{spec.arch}-{key}")
    return build_once(
        path,
        lambda tmp: make_tiny_reward_model(tmp, spec, score_scale=10.0),
        required=("config.json", "model.safetensors", "tokenizer.json"),
    )


def _hf_config(spec: TinySpec, vocab_size: int, eos_id: int):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tie_word_embeddings,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        bos_token_id=eos_id - 1,
        torch_dtype="float32",
    )
    if spec.head_dim is not None:
        common["head_dim"] = spec.head_dim
    elif spec.arch in ("qwen3", "qwen3_moe"):  # Qwen3Config's own default is 128, not hidden / heads
        common["head_dim"] = spec.hidden_size // spec.num_attention_heads
    if spec.rope_scaling is not None:
        # transformers 5 keeps rope_theta inside rope_parameters and writes that to config.json
        common["rope_parameters"] = {**spec.rope_scaling, "rope_theta": spec.rope_theta}
        del common["rope_theta"]
    if spec.arch == "llama":
        return LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    if spec.arch == "qwen2":
        return Qwen2Config(use_sliding_window=False, **common)
    if spec.arch == "qwen3":
        return Qwen3Config(use_sliding_window=False, attention_bias=False, **common)
    if spec.arch == "qwen3_moe":
        return Qwen3MoeConfig(
            use_sliding_window=False,
            attention_bias=False,
            num_experts=spec.num_experts or 4,
            num_experts_per_tok=spec.num_experts_per_tok or 2,
            moe_intermediate_size=spec.moe_intermediate_size or spec.intermediate_size // 2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
    raise InputError(f"tiny model arch {spec.arch!r} is not supported: use llama, qwen2, qwen3 or qwen3_moe")


def _model_class(arch: str):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    classes = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}
    return {**classes, "qwen3_moe": Qwen3MoeForCausalLM}[arch]


def _perturb(model, seed: int) -> None:
    """Random norms and biases too, so a mapping that drops or swaps them changes the logits."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # input/post-attention/final norms, Qwen3's q_norm/k_norm
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):  # MoE router: distinct top-k (no near-ties) per token
                p.copy_(torch.randn(p.shape, generator=gen))


def default_cache_dir() -> str:
    return os.environ.get("RLSTACK_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rlstack"))


def ensure_tiny_checkpoint(spec: Optional[TinySpec] = None, cache_dir: str | None = None) -> str:
    """The cached checkpoint for `spec`, built once (safe when several ranks call at once)."""
    spec = spec or TinySpec()
    fields = {k: v for k, v in asdict(spec).items() if v is not None}  # unset optional fields: same key as before
    key = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(cache_dir or default_cache_dir(), f"tiny-{spec.arch}-{key}")
    return build_once(
        path,
        lambda tmp: make_tiny_checkpoint(tmp, spec),
        required=("config.json", "model.safetensors", "tokenizer.json"),
    )
