"""FLOP counts of a PPO/GRPO step, from an HF config (pure Python: no torch).

Conventions (docs/benchmarks.md has the derivation):
- P = parameters that take part in matmuls: per layer QKV, attention output, gate/up, down; plus the
  LM head (vocab x hidden, counted even when tied: the logits are a matmul). The embedding lookup and
  the norms are not matmuls and are not counted.
- A forward over T tokens costs 2*P*T; forward+backward 6*P*T (backward = 2x forward). The actor's
  (and the reference's) LM head counts only at the positions that score a response token: the only
  log-probs a step reads, and the only ones rlstack computes (rlstack/workers/actor.py
  `read_positions`; TRL's `logits_to_keep` does the same).
- Causal attention over a sequence of s tokens adds, per layer, 2 FLOPs for each (query, key) pair
  j <= i for both Q.K^T and A.V: 2 * 2 * s(s+1)/2 * heads * head_dim (x3 with backward).
- Generation counts each prompt's prefill once per prompt (the floor: n samples can share it), then
  every response token at 2*P plus its attention over the prompt and the earlier response tokens.
- Mean lengths stand in for per-sequence lengths. Attention is convex in s, so this is a floor.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelDims:
    """The shapes that set the FLOP count of a Llama/Qwen2-family decoder."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int

    @classmethod
    def from_args(cls, args) -> ModelDims:
        """From the bridge's ModelArgs (megatron_bridge.hf_config: the one reader of config.json)."""
        return cls(
            hidden=args.hidden_size,
            layers=args.num_layers,
            heads=args.num_attention_heads,
            kv_heads=args.num_query_groups,
            head_dim=args.head_dim,
            ffn=args.ffn_hidden_size,
            vocab=args.vocab_size,
        )

    @classmethod
    def from_hf_dir(cls, hf_dir: str) -> ModelDims:
        from megatron_bridge.hf_config import ModelArgs, read_hf_config

        return cls.from_args(ModelArgs.from_hf_config(read_hf_config(hf_dir), hf_dir))

    def layer_linears(self, tp: int = 1) -> list[tuple[str, int, int]]:
        """(name, in_features, out_features) of one layer's matmuls on one of `tp` tensor-parallel ranks."""
        qkv_out = (self.heads + 2 * self.kv_heads) * self.head_dim
        return [
            ("qkv", self.hidden, qkv_out // tp),
            ("proj", self.heads * self.head_dim // tp, self.hidden),
            ("fc1", self.hidden, 2 * self.ffn // tp),
            ("fc2", self.ffn // tp, self.hidden),
        ]

    @property
    def layer_params(self) -> int:
        return sum(k * n for _, k, n in self.layer_linears())

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def body_matmul_params(self) -> int:
        """P without the LM head: the layers' matmuls."""
        return self.layers * self.layer_params

    @property
    def matmul_params(self) -> int:
        """P of the module docstring (LM head included)."""
        return self.layers * self.layer_params + self.lm_head_params

    @property
    def critic_matmul_params(self) -> int:
        """The critic: the same body with a scalar value head (hidden -> 1) instead of the LM head."""
        return self.layers * self.layer_params + self.hidden

    def attention_flops(self, seq_len: float, past: float = 0.0) -> float:
        """Forward attention FLOPs for queries at positions past..seq_len-1, keys up to each query."""
        pairs = _causal_pairs(seq_len) - _causal_pairs(past)
        return 4.0 * pairs * self.heads * self.head_dim * self.layers


def _causal_pairs(s: float) -> float:
    return s * (s + 1) / 2.0


@dataclass(frozen=True)
class StepShape:
    """One step's work: sequences, mean lengths, and which passes the trainer runs."""

    num_prompts: int  # over all data-parallel ranks
    samples_per_prompt: int
    prompt_len: float  # mean prompt tokens (chat template applied)
    response_len: float  # mean response tokens
    ppo_epochs: int = 1
    ref_forward: bool = True  # KL to a reference policy
    old_logprob_forward: bool = True  # a separate forward for the behaviour policy's log-probs
    critic: bool = False  # PPO: critic values forward + critic training
    # model.prefix_sharing: the log-prob, value and training passes run each prompt once for its samples
    shared_prompts: bool = False

    @property
    def num_sequences(self) -> int:
        return self.num_prompts * self.samples_per_prompt

    @property
    def seq_len(self) -> float:
        return self.prompt_len + self.response_len

    @property
    def train_tokens(self) -> float:
        return self.num_sequences * self.seq_len

    @property
    def response_tokens(self) -> float:
        return self.num_sequences * self.response_len

    @property
    def model_tokens(self) -> float:
        """Tokens a forward pass over the step's sequences runs: every row's, or with shared prompts
        each prompt once and every row's response."""
        if self.shared_prompts and self.samples_per_prompt > 1:
            return self.num_prompts * self.prompt_len + self.response_tokens
        return self.train_tokens


def forward_flops(dims: ModelDims, shape: StepShape, params: int, head_params: int = 0) -> float:
    """One forward over every sequence of the step: `params` at every token (prompt + response),
    `head_params` only at the positions that score a response token. With shared prompts the
    prompt's tokens and attention once per prompt, each response attending to it and to itself."""
    head = shape.num_sequences * 2.0 * head_params * shape.response_len
    if shape.model_tokens != shape.train_tokens:
        attention = shape.num_prompts * dims.attention_flops(shape.prompt_len) + shape.num_sequences * (
            dims.attention_flops(shape.seq_len, past=shape.prompt_len)
        )
        return 2.0 * params * shape.model_tokens + head + attention
    per_seq = 2.0 * params * shape.seq_len
    return shape.num_sequences * (per_seq + dims.attention_flops(shape.seq_len)) + head


def actor_forward_flops(dims: ModelDims, shape: StepShape) -> float:
    """The actor's (or reference's) log-prob forward: the layers at every token, the LM head at response ones."""
    return forward_flops(dims, shape, dims.body_matmul_params, dims.lm_head_params)


def prefill_flops(dims: ModelDims, shape: StepShape) -> float:
    """Each prompt's forward once (the n samples of a prompt can share it)."""
    return shape.num_prompts * (2.0 * dims.matmul_params * shape.prompt_len + dims.attention_flops(shape.prompt_len))


def decode_flops(dims: ModelDims, shape: StepShape) -> float:
    """Every response token: 2P plus its attention over the prompt and the earlier response tokens."""
    return shape.num_sequences * (
        2.0 * dims.matmul_params * shape.response_len + dims.attention_flops(shape.seq_len, past=shape.prompt_len)
    )


def generation_flops(dims: ModelDims, shape: StepShape) -> float:
    return prefill_flops(dims, shape) + decode_flops(dims, shape)


def step_flops(dims: ModelDims, shape: StepShape) -> dict[str, float]:
    """FLOPs of each pass of one step, and their total ("total")."""
    out = {"generation": generation_flops(dims, shape)}
    actor_fwd = actor_forward_flops(dims, shape)
    if shape.old_logprob_forward:
        out["old_logprob"] = actor_fwd
    if shape.ref_forward:
        out["ref_logprob"] = actor_fwd
    out["actor_train"] = 3.0 * actor_fwd * shape.ppo_epochs
    if shape.critic:
        critic_fwd = forward_flops(dims, shape, dims.critic_matmul_params)
        out["critic_values"] = critic_fwd
        out["critic_train"] = 3.0 * critic_fwd * shape.ppo_epochs
    out["total"] = sum(out.values())
    return out


def flops_per_token(dims: ModelDims, seq_len: float, params: int, train: bool = False) -> float:
    """Forward (or forward+backward) FLOPs per token of sequences of length seq_len."""
    per_token = 2.0 * params + dims.attention_flops(seq_len) / max(seq_len, 1.0)
    return 3.0 * per_token if train else per_token


def actor_flops_per_token(dims: ModelDims, shape: StepShape, train: bool = False) -> float:
    """The actor's forward (or forward+backward) FLOPs per token (prompt + response) of the step's
    sequences: the LM head's share spread over all tokens."""
    per_token = actor_forward_flops(dims, shape) / max(shape.train_tokens, 1.0)
    return 3.0 * per_token if train else per_token


def decode_flops_per_token(dims: ModelDims, context_len: float) -> float:
    """One generated token at mean context length context_len (KV cache: attention over the context)."""
    return 2.0 * dims.matmul_params + 4.0 * context_len * dims.heads * dims.head_dim * dims.layers
