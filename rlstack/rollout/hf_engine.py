"""Rollout with a transformers model and a KV-cache decode loop (the CPU default engine).

The model's parameters stay addressable, so the weight-sync bridge overwrites them in place
(`param_targets`). `generate()` of transformers is not used: its per-step bookkeeping (logits
processors, stopping criteria, full-vocabulary logits of every prompt position) costs more than the
model on small CPUs. The loop here runs prefill once per distinct prompt with `logits_to_keep=1` (the
KV cache copied to the prompt's n sample rows; the prompts' common prefix, a chat template's system
turn, prefilled once for all), then one token per step, and drops finished rows from
the batch (and its KV cache) as they stop, keeping at least `_MIN_DECODE_ROWS`. Three costs of transformers' defaults are avoided (SmolLM2,
16 rows x 64 tokens, one core: 211 -> 79 ms a step): the per-step `torch.cat` of the whole KV cache
(`_reserved_cache`), the copy of K/V to every query head under a padding mask (`_sdpa_gqa_attention`),
and F.linear's slow small-row matmuls on weights streamed from memory (`_packed_linears`). Llama,
Qwen2 and Qwen3 decode steps then skip transformers' per-module overhead (`lean_decode.LeanDecoder`:
88 -> 79 ms at 16 rows, 55 -> 49 ms at one).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch

from rlstack.rollout import cpu_gemm
from rlstack.rollout.interface import Generation, RolloutEngine, SamplingParams, check_row_caps
from rlstack.rollout.lean_decode import LeanDecoder, sdpa
from rlstack.rollout.sampling import sample_next

# Compact the batch (and its KV cache) once this share of its rows has stopped.
_COMPACT_FINISHED_SHARE = 0.25
# ...but keep at least this many rows (stopped ones decode on, unread): oneDNN's packed linears take
# longer for 1-2 rows than for 3-6 (SmolLM2's weights, AMD EPYC, 1 thread: 37 / 44 ms at 1 / 2 rows,
# 29-31 ms at 3-6, 54 ms at 16), and a generation's last live rows are most of its decode steps.
_MIN_DECODE_ROWS = 4
# A common prefix of the distinct prompts at least this long is prefilled once (_shared_prefix).
_MIN_SHARED_PREFIX = 8
# transformers' sdpa path, with grouped-query attention inside the kernel (see _sdpa_gqa_attention).
_ATTENTION = "rlstack_sdpa_gqa"


def _shared_prefix(prompts: list[list[int]]) -> int:
    """Length of the prompts' common prefix, leaving every prompt a token of its own; 0 when under
    `_MIN_SHARED_PREFIX` tokens or for a single prompt (one prefill call is then cheaper than two)."""
    if len(prompts) < 2:
        return 0
    shortest = min(len(p) for p in prompts) - 1
    n = 0
    while n < shortest and all(p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n if n >= _MIN_SHARED_PREFIX else 0


def _sdpa_gqa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, q, D]
    key: torch.Tensor,  # [B, G, k, D]; G key/value heads, H = G * num_key_value_groups
    value: torch.Tensor,  # [B, G, k, D]
    attention_mask: Optional[torch.Tensor],  # [B, 1, q, k] bool or None
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa_attention_forward` without its `repeat_kv` copy when a mask is present.

    transformers lets SDPA group the query heads itself (`enable_gqa`) only without a mask; with the
    left-padding mask of a batch it copies the whole KV cache to H heads in every layer at every
    decode step (on SmolLM2, 3 -> 9 heads: 12% of the decode step). The kernel's own GQA gives the
    same values bit for bit on CPU (tests/unit/test_hf_engine_attention.py) at ~1/3 of the time.
    """
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = query.shape[2] > 1 and attention_mask is None and causal
    # bf16 on CPU: in fp32 (lean_decode.sdpa: torch's bf16 CPU kernel is ~6x slower at these shapes)
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    out = sdpa(query, key, value, attention_mask, scaling, causal=causal, gqa=gqa, dropout=dropout)
    return out.transpose(1, 2).contiguous(), None  # [B, q, H, D]


def _reserved_layer_class():
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):
        """A DynamicLayer that writes each new token into room reserved at prefill, not `torch.cat`.

        `DynamicLayer.update` concatenates: every decode step copies the whole KV cache of every layer
        (SmolLM2, 16 rows x 180 tokens: 133 MB a step, a quarter of the weights' bytes the step reads).
        Here the buffers hold `capacity` positions; `keys`/`values` are views of the filled part.
        """

        def __init__(self, capacity: int):
            super().__init__()
            self.capacity = capacity
            self.length = 0

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            batch, heads, new, dim = key_states.shape  # [B, G, q, D]
            if not self.is_initialized:
                self.dtype, self.device = key_states.dtype, key_states.device
                self._k = key_states.new_empty((batch, heads, max(self.capacity, new), dim))
                self._v = value_states.new_empty((batch, heads, max(self.capacity, new), dim))
                self.is_initialized = True
            if self.length + new > self._k.shape[2]:  # past the reserve (not expected): fall back to growing
                grow = max(new, self._k.shape[2])
                self._k = torch.cat([self._k, self._k.new_empty((batch, heads, grow, dim))], dim=2)
                self._v = torch.cat([self._v, self._v.new_empty((batch, heads, grow, dim))], dim=2)
            self._k[:, :, self.length : self.length + new] = key_states
            self._v[:, :, self.length : self.length + new] = value_states
            self.length += new
            self._views()
            return self.keys, self.values

        def _views(self) -> None:
            self.keys, self.values = self._k[:, :, : self.length], self._v[:, :, : self.length]  # [B, G, n, D]

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.is_initialized and self.length > 0:
                self._k, self._v = self._k[indices], self._v[indices]
                self._views()

    return ReservedLayer


def _reserved_cache(config, capacity: int):
    """A DynamicCache whose full-attention layers reserve `capacity` positions (sliding ones unchanged)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    layer = _reserved_layer_class()
    cache.layers = [layer(capacity) if type(x) is DynamicLayer else x for x in cache.layers]
    return cache


def _reservable(config) -> bool:
    """Every layer of the model's cache reserves its room (`ReservedLayer`: full attention). The turn
    cache places kept KV into each layer; a sliding-window layer keeps only its window."""
    return all(hasattr(layer, "capacity") for layer in _reserved_cache(config, 1).layers)


@dataclass
class _KeptKV:
    length: int  # tokens it covers
    layers: list  # per layer (keys, values), each [G, length, D]
    nbytes: int


class TurnKV:
    """The KV of the rows generate() made, kept between an agent's turns (`HFEngine.keep_turn_kv`) and
    found by content: a prompt that starts with a kept row's ids (and has more) reuses its KV. Rows go
    in while room is left under `budget_bytes` (the rest re-prefill next turn: slower, never wrong);
    a row found leaves the cache, its continuation coming back in its place."""

    _MOD = (1 << 61) - 1  # a polynomial hash of each prefix, one pass over a prompt
    _BASE = 1_000_003

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.used = 0
        self.entries: dict[tuple[int, int], tuple[list[int], _KeptKV]] = {}  # (length, hash) -> (ids, KV)
        self.lengths: dict[int, int] = {}  # length -> entries of that length

    @classmethod
    def _prefix_hashes(cls, ids: list[int]) -> Iterator[tuple[int, int]]:
        h = 0
        for n, tok in enumerate(ids, 1):
            h = (h * cls._BASE + tok + 1) % cls._MOD
            yield n, h

    def put(self, ids: list[int], layers: list) -> bool:
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        if not ids or self.used + nbytes > self.budget:
            return False
        *_, (n, h) = self._prefix_hashes(ids)
        if (n, h) in self.entries:  # the same ids twice (greedy samples of one prompt): one is enough
            return False
        self.entries[(n, h)] = (list(ids), _KeptKV(n, layers, nbytes))
        self.lengths[n] = self.lengths.get(n, 0) + 1
        self.used += nbytes
        return True

    def take(self, prompts: list[list[int]]) -> list[Optional[_KeptKV]]:
        """Each prompt's longest kept prefix leaving it at least one token to prefill, or None. The ones
        found leave the cache (held by the caller until their rows are prefilled)."""
        found: list[Optional[tuple[int, int]]] = []
        for p in prompts:
            best = None
            if self.lengths:
                for n, h in self._prefix_hashes(p[:-1]):
                    if n in self.lengths and (n, h) in self.entries and self.entries[(n, h)][0] == p[:n]:
                        best = (n, h)
            found.append(best)
        kept = [self.entries[key][1] if key is not None else None for key in found]
        for key in set(filter(None, found)):
            _, kv = self.entries.pop(key)
            self.used -= kv.nbytes
            self.lengths[key[0]] -= 1
            if not self.lengths[key[0]]:
                del self.lengths[key[0]]
        return kept


def _packed_forward(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # x [..., k] -> [..., n]


def _avx2_forward(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], n: int) -> torch.Tensor:
    return cpu_gemm.linear(x, packed, bias, n)  # x [..., k] -> [..., n] (rollout.cpu_matmul)


def _can_pack(model: torch.nn.Module) -> bool:
    p = next(model.parameters())
    if p.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return p.dtype == torch.float32 or (p.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class _Packed(dict):
    """{module: packed weight} of `_packed_linears`, and which kernel the weights were packed for."""

    def __init__(self, kernel: str = ""):
        super().__init__()
        self.kernel = kernel  # "avx2" (cpu_gemm), "onednn", or "" where nothing was packed


@contextlib.contextmanager
def _packed_linears(model: torch.nn.Module, rows: int, enabled: bool = True, kernel: str = "auto") -> Iterator[_Packed]:
    """Every nn.Linear runs on a oneDNN copy of its weight, reordered for `rows` rows, inside the block.

    A decode step multiplies ~16 rows by each weight once, streaming all of them from memory; torch's
    F.linear reaches ~55 GFLOP/s there on one AVX-512 core (SmolLM2: 80 ms a step), the reordered
    weights ~140 (31 ms), near the memory bandwidth. The copies are built per generate() call, after
    any weight sync (so they always match the parameters the sync writes into), and freed at its end:
    +1x the linear weights during rollout only. Values differ from F.linear by rounding (~3e-6
    relative). Yields {module: packed weight} (empty where packing does not apply: GPU, bf16, no oneDNN),
    its `kernel` the one packed for: where `cpu_gemm.use_kernel` says so (`kernel`: rollout.cpu_matmul;
    AVX2-only CPUs and AMD Zen 4), fp32 weights are packed for rlstack's own kernel instead (cpu_gemm.py:
    1.2-1.9x oneDNN's speed at decode's 4-16 rows there).
    """
    if not (enabled and _can_pack(model)):
        yield _Packed()
        return
    avx2 = cpu_gemm.use_kernel(kernel, next(model.parameters()).dtype)
    packed = _Packed("avx2" if avx2 else "onednn")
    try:
        for mod in model.modules():
            merged = mod.__dict__.get("lora_merged")  # rollout.lora_sync=merged: W + scale B A (any linear)
            if isinstance(mod, torch.nn.Linear) or merged is not None or getattr(mod, "grouped_linear", False):
                weight = mod.weight.detach() if merged is None else merged
                # a zero-copy GroupedLinear's [G, R, H] view of megatron's fused QKV: packed as HF's [G*R, H]
                # (one oneDNN matmul instead of one MKL one per group: SmolLM2 q/k/v at 16 rows 217 -> ~80 us)
                weight = weight.reshape(-1, weight.shape[-1])
                bias = _flat_bias(mod)
                if avx2:
                    packed[mod] = cpu_gemm.pack(weight)
                    forward = functools.partial(_avx2_forward, packed=packed[mod], bias=bias, n=weight.shape[0])
                else:
                    packed[mod] = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
                    forward = functools.partial(_packed_forward, packed=packed[mod], bias=bias)
                mod.forward = _with_lora(mod, forward)
        yield packed
    finally:
        for mod in packed:
            del mod.forward  # the class's own forward again
            _install_lora(mod)  # ... plus its LoRA adapter, if it has one


class _LoraDelta:
    """scale * B (A x) of one HF linear (A [r, in], B [out, r]): the adapter the engine adds (model.lora)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, scale: float):
        self.a, self.b, self.scale = a, b, scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # the actor's order (megatron_bridge.lora.LoraAdapter.delta): h = x A^T, then h B^T, then scale
        return torch.nn.functional.linear(torch.nn.functional.linear(x, self.a), self.b) * self.scale


def _with_lora(mod: torch.nn.Module, forward):
    """`forward` plus the module's LoRA delta, if `set_adapters` gave it one. Kept as an instance
    `forward` (not a hook): LeanDecoder calls the linears' `forward` directly."""
    delta = mod.__dict__.get("lora_delta")
    if delta is None:
        return forward
    return lambda x: forward(x) + delta(x)


def _flat_bias(mod: torch.nn.Module) -> Optional[torch.Tensor]:
    bias = getattr(mod, "bias", None)
    return None if bias is None else bias.reshape(-1)  # a GroupedLinear's grouped view [G, R] -> HF's [G*R]


def _merged_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def _install_lora(mod: torch.nn.Module) -> None:
    merged = mod.__dict__.get("lora_merged")
    if merged is not None:  # the merged weight instead of the (aliased) base
        mod.forward = functools.partial(_merged_forward, weight=merged, bias=_flat_bias(mod))
    elif mod.__dict__.get("lora_delta") is not None:
        mod.forward = _with_lora(mod, type(mod).forward.__get__(mod))
    else:
        mod.__dict__.pop("forward", None)


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(_ATTENTION, _sdpa_gqa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(_ATTENTION, sdpa_mask)  # the masks sdpa gets


@dataclass
class _Counters:
    tokens: int = 0
    sequences: int = 0
    seconds: float = 0.0
    packed_bytes: int = 0  # the largest oneDNN weight copy held during a generate() (rollout.pack_weights)
    decode_steps: int = 0  # forwards of one token a row, after each batch's prefill
    decode_rows: int = 0  # rows those forwards carried, summed: live ones and stopped ones kept
    prefill_tokens: int = 0  # context tokens the prefills computed (pads left out)
    reused_tokens: int = 0  # context tokens whose KV came from the turn cache instead (agent turns)


class HFEngine(RolloutEngine):
    target_layout = "hf"  # param_targets(): HF checkpoint names and shapes

    def __init__(
        self,
        hf_dir: str,
        rollout_cfg,
        device,
        eos_token_id: int,
        pad_token_id: int,
        seed: int = 0,
        dtype: Optional[torch.dtype] = None,  # None: float32 on CPU, bfloat16 on GPU (base.hf_engine_dtype)
    ):
        from transformers import AutoModelForCausalLM

        self.cfg = rollout_cfg
        self.device = torch.device(device)
        if dtype is None:
            dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        _register_attention()
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, attn_implementation=_ATTENTION)
        self.model = self.model.to(self.device)
        self.model.eval().requires_grad_(False)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.base_seed = seed
        self._seed_offset: Optional[int] = None
        self._generator: Optional[torch.Generator] = None
        self._counters = _Counters()
        self._turn_kv: Optional[TurnKV] = None  # inside keep_turn_kv(): the trajectories' KV between turns
        self._held_pack: Optional[dict] = None  # inside keep_turn_kv(): the packed weights of all its calls
        # colocated CPU ranks: threads other ranks of the host lend while they wait (rollout/host_cores.py)
        self.cores = None

    # ------------------------------------------------------------------ weights

    def param_targets(self) -> dict[str, torch.Tensor]:
        # named_parameters() lists a tied lm_head once (as model.embed_tokens.weight), as HF saves it.
        return dict(self.model.named_parameters())

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        targets = self.param_targets()
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in targets:
                    raise ValueError(f"hf engine has no parameter {name!r}")
                if tuple(tensor.shape) != tuple(targets[name].shape):
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != engine {tuple(targets[name].shape)}")
                targets[name].copy_(tensor)

    def set_adapters(
        self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float, merged: bool = False
    ) -> int:
        """LoRA (rlstack/rollout/lora_sync.py): each named linear (`model.layers.0.self_attn.q_proj`)
        computes `W x + scale * B (A x)` from now on, W staying the (aliased) base weight.
        `merged` (rollout.lora_sync=merged): it computes `(W + scale * B A) x` instead, from a weight of
        its own (+1x the adapted linears' bytes); W itself is not written, so it stays aliased.
        Returns the bytes written into the engine: the adapters, or the merged weights."""
        written = 0
        for name, (a, b) in adapters.items():
            mod = self.model.get_submodule(name)
            a, b = a.to(self.device, mod.weight.dtype), b.to(self.device, mod.weight.dtype)
            if merged:
                written += self._set_merged(mod, a, b, scale)
                continue
            mod.__dict__.pop("lora_merged", None)
            delta = mod.__dict__.get("lora_delta")
            if delta is None:
                mod.lora_delta = _LoraDelta(a, b, scale)
                _install_lora(mod)
            else:
                delta.a, delta.b, delta.scale = a, b, scale
            written += a.numel() * a.element_size() + b.numel() * b.element_size()
        return written

    @staticmethod
    def _set_merged(mod: torch.nn.Module, a: torch.Tensor, b: torch.Tensor, scale: float) -> int:
        base = mod.weight.detach()
        base = base.reshape(-1, base.shape[-1])  # a GroupedLinear's grouped view [G, R, H] -> HF's [G*R, H]
        target = mod.__dict__.get("lora_merged")
        if target is None:
            target = torch.empty(base.shape, dtype=base.dtype, device=base.device)
        torch.addmm(base, b, a, alpha=scale, out=target)  # W + scale * B A
        mod.__dict__.pop("lora_delta", None)
        mod.lora_merged = target
        _install_lora(mod)
        return target.numel() * target.element_size()

    # ------------------------------------------------------------------ generation

    @contextlib.contextmanager
    def keep_turn_kv(self, budget_bytes: int) -> Iterator[None]:
        """Inside the block, every row generate() makes keeps its KV (context + response but its last
        token) in a `TurnKV` of at most `budget_bytes`, and a later prompt that starts with a kept row's
        ids prefills only the rest: an agent's next turn (rlstack.agent.driver) prefills the tool's ids
        and not its whole history again. All of it is freed at the end of the block (one rollout: the
        weights do not change inside it)."""
        if budget_bytes <= 0 or not _reservable(self.model.config):
            yield
            return
        self._turn_kv = TurnKV(budget_bytes)
        # The oneDNN weight copies too are made once for all the turns, not at every call (~0.1 s each
        # on SmolLM2, 2 cores: a third of what a 16-row turn's prefill of 17 new tokens a row takes).
        pack = getattr(self.cfg, "pack_weights", True)
        try:
            kernel = getattr(self.cfg, "cpu_matmul", "auto")
            with _packed_linears(self.model, max(1, self.cfg.micro_batch_size), pack, kernel) as packed:
                self._held_pack = packed
                yield
        finally:
            self._turn_kv = None
            self._held_pack = None

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, max_new_tokens: Optional[list[int]] = None
    ) -> list[Generation]:
        from rlstack import preemption

        # rollout.timeout_s: a hung generation stops the run naming engine, rank and step (docs/reliability.md)
        with preemption.rollout_watchdog(getattr(self.cfg, "timeout_s", 0.0), "hf"):
            preemption.fault_hang()
            try:
                return self._generate(prompts, params, max_new_tokens)
            finally:
                if self.cores is not None:
                    self.cores.give_back()  # before this rank meets the others

    def _generate(
        self, prompts: list[list[int]], params: SamplingParams, max_new_tokens: Optional[list[int]]
    ) -> list[Generation]:
        params.validate()
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        caps = check_row_caps(max_new_tokens, len(prompts), params)
        start = time.perf_counter()
        generator = self._sampler(params)
        rows = [(i, prompts[i]) for i in range(len(prompts)) for _ in range(params.n)]  # prompt-major
        # Similar lengths together: less left padding per micro-batch. Results go back in row order.
        order = sorted(range(len(rows)), key=lambda r: len(rows[r][1]))
        results: list[Optional[Generation]] = [None] * len(rows)
        mbs = max(1, self.cfg.micro_batch_size)
        # Agent turns: each row's kept KV (a prefix of its prompt), taken out of the cache now (its
        # continuation replaces it); None where nothing kept matches.
        kept = self._turn_kv.take([p for _, p in rows]) if self._turn_kv is not None else [None] * len(rows)
        packing = (
            _packed_linears(
                self.model,
                min(mbs, len(rows)),
                getattr(self.cfg, "pack_weights", True),
                getattr(self.cfg, "cpu_matmul", "auto"),
            )
            if self._held_pack is None
            else contextlib.nullcontext(self._held_pack)  # inside keep_turn_kv: made once for all turns
        )
        with packing as packed:
            nbytes = sum(m.weight.numel() * m.weight.element_size() for m in packed)
            self._counters.packed_bytes = max(self._counters.packed_bytes, nbytes)
            # Decode steps on the packed weights without transformers' per-module overhead (lean_decode.py).
            # ... and its attention on rlstack's AVX2 kernel where the linears run on that library
            fast = bool(packed) and packed.kernel == "avx2"
            lean = LeanDecoder(self.model, fast) if packed and LeanDecoder.supports(self.model) else None
            for lo in range(0, len(order), mbs):
                chunk = order[lo : lo + mbs]
                chunk_caps = [caps[rows[r][0]] for r in chunk]
                chunk_kept = [kept[r] for r in chunk]
                batch = self._generate_batch([rows[r] for r in chunk], params, generator, lean, chunk_caps, chunk_kept)
                for r, gen in zip(chunk, batch):
                    results[r] = gen
                    kept[r] = None  # its KV is in this batch's cache now (and freed with it)
        self._counters.seconds += time.perf_counter() - start
        self._counters.sequences += len(rows)
        self._counters.tokens += sum(len(g.response_ids) for g in results)
        return results

    def _sampler(self, params: SamplingParams) -> torch.Generator:
        """One generator per engine, reseeded only when `params.seed` changes (successive calls differ)."""
        if self._generator is None or params.seed != self._seed_offset:
            self._generator = torch.Generator(device=self.device).manual_seed(self.base_seed + params.seed)
            self._seed_offset = params.seed
        return self._generator

    @torch.no_grad()
    def _generate_batch(
        self,
        rows: list[tuple[int, list[int]]],
        params: SamplingParams,
        generator: torch.Generator,
        lean: Optional[LeanDecoder] = None,
        caps: Optional[list[int]] = None,  # [B] each row's max_new_tokens (agent turns); None: params'
        kept: Optional[list[Optional[_KeptKV]]] = None,  # [B] each row's kept KV (keep_turn_kv), or None
    ) -> list[Generation]:
        batch = len(rows)
        row_caps = torch.tensor(caps or [params.max_new_tokens] * batch, dtype=torch.long)  # [B]
        max_steps = int(row_caps.max())
        if kept is not None and any(k is not None for k in kept):
            cache, logits, mask, positions = self._prefill_kept(rows, kept, max_steps)
        else:
            cache, logits, mask, positions = self._prefill(rows, max_steps)
        context_mask, context_len = mask, mask.shape[1]  # [B, L]: the rows' context slots in the cache
        tokens = torch.empty((batch, max_steps), dtype=torch.long)  # [B, N] on the host
        logprobs = torch.empty((batch, max_steps), dtype=torch.float32)
        lengths = row_caps.clone()  # response length per row
        stopped = torch.zeros(batch, dtype=torch.bool)  # at eos
        done = torch.zeros(batch, dtype=torch.bool)  # at eos or at the row's cap
        active = torch.arange(batch)  # original row of each live batch row
        next_pos = positions[:, -1] + 1  # [b]
        turn_kv = self._turn_kv

        def keep_kv(at: torch.Tensor) -> None:  # batch rows `at` are done: their KV into the turn cache
            if turn_kv.used >= turn_kv.budget:  # full: no row would go in, so gather none
                return
            for j in at.tolist():
                b = int(active[j])
                fed = int(lengths[b]) - 1  # response tokens fed to the model (the last one never is)
                fed_slots = torch.arange(context_len, context_len + fed, device=context_mask.device)
                slots = torch.cat([context_mask[b].nonzero().squeeze(-1), fed_slots])
                ids = rows[b][1] + tokens[b, :fed].tolist()
                turn_kv.put(ids, [(layer._k[j, :, slots], layer._v[j, :, slots]) for layer in cache.layers])

        for step in range(max_steps):
            if self.cores is not None:
                self.cores.take()  # what ranks done with their rows lend now
            tok, lp = sample_next(logits, params, generator)  # [b], [b]
            tokens[active, step], logprobs[active, step] = tok.cpu(), lp.float().cpu()
            newly = (tok == self.eos_token_id).cpu() & ~done[active]  # [b]
            lengths[active[newly]] = step + 1
            stopped[active[newly]] = True
            done[active[(row_caps[active] == step + 1) | newly]] = True
            if step == max_steps - 1 or bool(done.all()):
                break
            keep = ~done[active]  # [b]; finished rows still in the batch decode on, unread
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # [b, L+step+1]
            if (~keep).float().mean() >= _COMPACT_FINISHED_SHARE:
                idx = self._rows_to_keep(keep)
                if len(idx) < len(keep):
                    if turn_kv is not None:
                        dropped = torch.ones(len(keep), dtype=torch.bool)
                        dropped[idx] = False
                        keep_kv(dropped.nonzero().squeeze(-1))
                    cache.batch_select_indices(idx.to(self.device))
                    tok, mask, next_pos, active = tok[idx], mask[idx], next_pos[idx], active[idx]
            if lean is not None:
                logits = lean.step(tok, next_pos, mask, cache)  # [b, V]
            else:
                logits = self.model(
                    input_ids=tok.unsqueeze(-1),
                    attention_mask=mask,
                    position_ids=next_pos.unsqueeze(-1),
                    past_key_values=cache,
                    use_cache=True,
                ).logits[:, -1]  # [b, V]
            next_pos = next_pos + 1
            self._counters.decode_steps += 1
            self._counters.decode_rows += len(tok)
        if turn_kv is not None:
            keep_kv(torch.arange(len(active)))
        return [
            self._row_result(rows[b], tokens[b], logprobs[b], int(lengths[b]), bool(stopped[b])) for b in range(batch)
        ]

    def _prefill(self, rows: list[tuple[int, list[int]]], max_steps: int):
        """Prefill each row's prompt -> (cache, last logits [B, V], mask [B, L], position ids [B, L'])."""
        batch = len(rows)
        # Prefill each distinct prompt once and copy its KV cache to its n sample rows: the n samples of
        # a prompt share every prefill FLOP (with ~75-token prompts and ~25-token answers, prefill was
        # most of the rollout when each sample ran its own).
        unique, row_of = self._distinct_prompts(rows)  # [U] prompts, [B] index into them
        # The distinct prompts' common prefix (a chat template's system turn: 24 of SmolLM2's ~77
        # tokens) is prefilled once, its KV cache copied to every prompt, then the rest of each.
        shared = _shared_prefix(unique)
        input_ids, suffix_mask = self._left_pad([p[shared:] for p in unique])  # [U, L - shared] each
        mask = torch.cat([suffix_mask.new_ones((len(unique), shared)), suffix_mask], dim=1)  # [U, L]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, shared:]  # [U, L - shared]
        cache = _reserved_cache(self.model.config, mask.shape[1] + max_steps)
        if shared:
            prefix = torch.tensor([unique[0][:shared]], dtype=torch.long, device=self.device)  # [1, shared]
            self.model(input_ids=prefix, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache.batch_select_indices(torch.zeros(len(unique), dtype=torch.long, device=self.device))
        logits = self._prefill_logits(input_ids, mask, positions, cache)  # [U, V]
        self._counters.prefill_tokens += shared + int(suffix_mask.sum())
        if len(unique) < batch:
            expand = row_of.to(self.device)
            cache.batch_select_indices(expand)  # [U, ...] -> [B, ...]
            logits, mask, positions = logits[expand], mask[expand], positions[expand]
        return cache, logits, mask, positions

    def _prefill_kept(self, rows: list[tuple[int, list[int]]], kept: list[Optional[_KeptKV]], max_steps: int):
        """`_prefill` for rows some of which have kept KV: the cache starts with each row's kept KV
        (right-aligned in K slots, zeros and mask 0 before it), then each row's rest, left-padded:
        [0.. | kept | 0.. | rest]; position ids count the mask's ones, so each row runs 0, 1, 2, ...
        over its own tokens as if it had been prefilled whole."""
        batch = len(rows)
        known = [k.length if k is not None else 0 for k in kept]
        width = max(known)  # K
        input_ids, suffix_mask = self._left_pad([p[n:] for (_, p), n in zip(rows, known)])  # [B, S]
        kept_mask = torch.zeros((batch, width), dtype=suffix_mask.dtype, device=suffix_mask.device)
        for b, n in enumerate(known):
            kept_mask[b, width - n :] = 1
        mask = torch.cat([kept_mask, suffix_mask], dim=1)  # [B, K + S]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, width:]  # [B, S]
        cache = _reserved_cache(self.model.config, mask.shape[1] + max_steps)
        for li, layer in enumerate(cache.layers):
            k0, v0 = next(k.layers[li] for k in kept if k is not None)  # [G, n, D]
            shape = (batch, k0.shape[0], layer.capacity, k0.shape[2])
            layer._k, layer._v = k0.new_zeros(shape), v0.new_zeros(shape)  # zeros: masked slots stay finite
            for b, k in enumerate(kept):
                if k is not None:
                    layer._k[b, :, width - k.length : width] = k.layers[li][0]
                    layer._v[b, :, width - k.length : width] = k.layers[li][1]
            layer.dtype, layer.device, layer.is_initialized, layer.length = k0.dtype, k0.device, True, width
            layer._views()
        logits = self._prefill_logits(input_ids, mask, positions, cache)  # [B, V]
        self._counters.prefill_tokens += int(suffix_mask.sum())
        self._counters.reused_tokens += sum(known)
        return cache, logits, mask, positions

    def _prefill_logits(self, input_ids, mask, positions, cache) -> torch.Tensor:
        """Prefill input_ids [b, S] into `cache` -> the last position's logits [b, V] (logits_to_keep=1)."""
        return self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]

    @staticmethod
    def _rows_to_keep(keep: torch.Tensor) -> torch.Tensor:
        """Batch rows to decode on [k]: the live ones, topped up with stopped ones to `_MIN_DECODE_ROWS`."""
        rows = keep.nonzero().squeeze(-1)
        short = min(_MIN_DECODE_ROWS, len(keep)) - len(rows)
        if short > 0:
            rows = torch.cat([rows, (~keep).nonzero().squeeze(-1)[:short]]).sort().values
        return rows

    @staticmethod
    def _distinct_prompts(rows: list[tuple[int, list[int]]]) -> tuple[list[list[int]], torch.Tensor]:
        """rows (prompt index, prompt) -> the distinct prompts in first-seen order, and each row's one."""
        first: dict[int, int] = {}
        for prompt_index, _ in rows:
            first.setdefault(prompt_index, len(first))
        unique = [None] * len(first)
        for prompt_index, prompt in rows:
            unique[first[prompt_index]] = prompt
        return unique, torch.tensor([first[i] for i, _ in rows], dtype=torch.long)  # [B]

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """prompts -> input ids [B, L] left-padded with pad_token_id, attention mask [B, L]."""
        batch, max_len = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((batch, max_len), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((batch, max_len), dtype=torch.long)
        for b, prompt in enumerate(prompts):
            input_ids[b, max_len - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[b, max_len - len(prompt) :] = 1
        return input_ids.to(self.device), mask.to(self.device)

    @staticmethod
    def _row_result(row, tokens, logprobs, length: int, stopped: bool) -> Generation:
        prompt_index, prompt = row
        return Generation(
            prompt_index=prompt_index,
            prompt_ids=list(prompt),
            response_ids=tokens[:length].tolist(),
            logprobs=logprobs[:length].tolist(),
            finish_reason="stop" if stopped else "length",
        )

    # ------------------------------------------------------------------ metrics

    def metrics(self) -> dict:
        c, self._counters = self._counters, _Counters()
        return {
            "rollout/tokens": c.tokens,
            "rollout/sequences": c.sequences,
            "rollout/seconds": c.seconds,
            "rollout/tokens_per_s": c.tokens / c.seconds if c.seconds > 0 else 0.0,
            "rollout/packed_weight_bytes": c.packed_bytes,
            "rollout/prefill_tokens": c.prefill_tokens,
            "rollout/kv_reused_tokens": c.reused_tokens,
            **self._decode_metrics(c),
        }

    @staticmethod
    def _decode_metrics(c: _Counters) -> dict:
        """How full the decode steps ran. A response's first token comes from its prefill, each later one
        from one decode step: live rows summed over the steps = tokens - sequences. The rest of
        `decode_rows` are stopped rows decoded on (`_MIN_DECODE_ROWS`, compaction's threshold)."""
        if c.decode_steps == 0:
            return {"rollout/decode_steps": 0}
        return {
            "rollout/decode_steps": c.decode_steps,
            "rollout/decode_rows_mean": c.decode_rows / c.decode_steps,
            "rollout/decode_live_share": (c.tokens - c.sequences) / c.decode_rows,
        }
