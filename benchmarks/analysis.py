"""From the raw measurements of one benchmark run to the figures of the table (pure Python).

`derive(results)` reads the dict that run.py assembles (setup, model, trainer steps, stages,
ceilings, trl; any part may hold {"error": ...} or {"skipped": ...}) and returns the figures, each as
a `Stat` dict (median, min, max, n) where it has repetitions, with fractions of the machine's
ceilings, the FLOP floor of a step, the TRL ratios and the project's targets.
"""

from __future__ import annotations

import statistics
from typing import Optional

from benchmarks.bytes import Layout, forward_bytes, phase_flops, roofline, step_bytes
from benchmarks.flops import (
    ModelDims,
    StepShape,
    actor_flops_per_token,
    actor_forward_flops,
    decode_flops_per_token,
    forward_flops,
    step_flops,
)

STAGE_KEYS = ("timing/sync_s", "timing/rollout_s", "timing/score_s", "timing/update_s")
# Rank 0's peak memory in each phase of a step (the trainer's PhaseMemory), host and GPU.
PHASES = ("sync", "rollout", "scoring", "update")
PHASE_MEMORY_KEYS = tuple(f"mem/{kind}/{phase}" for kind in ("peak_gib", "gpu_peak_gib") for phase in PHASES)
TRAINER_KEYS = (
    "timing/step_s",
    *STAGE_KEYS,
    "timing/actor_update_s",
    "timing/critic_update_s",
    "throughput/rollout_tok_s",
    "rollout/decode_steps",
    "rollout/decode_rows_mean",
    "rollout/decode_live_share",
    "throughput/actor_tok_s",
    "throughput/critic_tok_s",
    "sync/seconds",
    "sync/bytes",
    "sync/peak_extra_bytes",
    "response/length_mean",
    "mem/rss_peak_gib",
    "mem/gpu_peak_gib",
    *PHASE_MEMORY_KEYS,
    "reward/mean",
)
# Targets (by `make bench`, same work, one run): reported next to the measurement, never asserted.
TARGETS = {
    "peak_memory_vs_trl": ("<=", 0.7, "peak memory, all ranks / TRL's (same work)"),
    "rank_memory_vs_state": (
        "<=",
        1.3,
        "peak memory of each rank / its training state (params + grads + optimizer shard)",
    ),
    "step_time_vs_trl": ("<=", 0.6, "GRPO step time / TRL's"),
    "step_time_vs_trl_every_cpu": ("<=", 0.5, "GRPO step time / TRL's, on every CPU kind (issue 40)"),
    "rollout_decode_fraction": (">=", 0.6, "rollout tokens/s in the step / decode ceiling"),
    "step_floor_fraction": (">=", 0.7, "FLOP-floor time / step time"),
    "step_roofline_fraction": (">=", 0.8, "roofline-floor time (FLOPs and bytes) / step time (issue 40)"),
    "sync_bytes": ("<=", 0, "weight sync bytes moved where layouts agree (rank 0)"),
}
GIB = 2**30


def stat(values: list[float]) -> Optional[dict]:
    """Median and spread of repeated measurements (None when there are none)."""
    values = [float(v) for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def scaled(s: Optional[dict], factor: float) -> Optional[dict]:
    if s is None:
        return None
    return {**s, "median": s["median"] * factor, "min": s["min"] * factor, "max": s["max"] * factor}


def over(numerator: float, s: Optional[dict]) -> Optional[dict]:
    """numerator / each value of a stat (min and max swap places)."""
    if s is None:
        return None
    return {"median": numerator / s["median"], "min": numerator / s["max"], "max": numerator / s["min"], "n": s["n"]}


def _ok(part) -> bool:
    return isinstance(part, dict) and "error" not in part and "skipped" not in part


def measured_steps(rows: list[dict], warmup: int) -> list[dict]:
    """Training-step rows of metrics.jsonl (validation-only rows have no step time), warm-up dropped."""
    steps = [r for r in rows if "timing/step_s" in r]
    return steps[warmup:]


def trainer_rows(results: dict) -> list[dict]:
    """Measured steps; a trainer that failed late still gives the steps it finished."""
    tr = results.get("trainer", {})
    return measured_steps(tr.get("steps", []), results["setup"].get("warmup_steps", 1))


def trainer_figures(results: dict) -> dict:
    rows = trainer_rows(results)
    if not rows:
        return {}
    out = {k: stat([r[k] for r in rows if k in r]) for k in TRAINER_KEYS}
    other = [r["timing/step_s"] - sum(r.get(k, 0.0) for k in STAGE_KEYS) for r in rows]
    out["timing/other_s"] = stat(other)
    # the update outside the actor's and critic's training: old/reference log-probs, values, advantages
    trained = ("timing/actor_update_s", "timing/critic_update_s")
    out["timing/update_forwards_s"] = stat(
        [r["timing/update_s"] - sum(r.get(k, 0.0) for k in trained) for r in rows if "timing/actor_update_s" in r]
    )
    gen = [r["throughput/rollout_tok_s"] * r["timing/rollout_s"] for r in rows if "throughput/rollout_tok_s" in r]
    out["step/gen_tokens"] = stat(gen)
    out["step/gen_tok_s"] = stat([g / r["timing/step_s"] for g, r in zip(gen, rows)])
    return {k: v for k, v in out.items() if v is not None}


def step_shape(results: dict, figures: dict) -> Optional[StepShape]:
    s, st = results["setup"], results.get("stages", {})
    prompt_len = st.get("prompt_len_mean") if _ok(st) else None
    response = figures.get("response/length_mean")
    response_len = response["median"] if response else (st.get("response_len_mean") if _ok(st) else None)
    if prompt_len is None or response_len is None:
        return None
    return StepShape(
        num_prompts=s["prompts"],
        samples_per_prompt=s["n"],
        prompt_len=prompt_len,
        response_len=response_len,
        ppo_epochs=s.get("ppo_epochs", 1),
        ref_forward=s.get("reference", True),
        old_logprob_forward=s.get("old_logprob_forward", True),
        critic=s.get("algorithm") == "ppo",
        shared_prompts=bool(s.get("prefix_sharing", False)),
    )


def ceiling_figures(results: dict, dims: ModelDims, shape: Optional[StepShape], figures: dict) -> dict:
    """Each throughput as a fraction of the machine's ceiling at the model's shapes."""
    c = results.get("ceilings", {})
    if not _ok(c) or shape is None:
        return {}
    train_rate, decode_rate = c["train_flops_per_s_total"], c["decode_flops_per_s_total"]
    decode_ceiling = decode_rate / decode_flops_per_token(dims, shape.prompt_len + shape.response_len / 2)
    # the critic's forward per token of the step's rows (shared prompts counted once, as the actor's)
    critic_fwd_per_token = forward_flops(dims, shape, dims.critic_matmul_params) / max(shape.train_tokens, 1.0)
    out = {
        "ceiling/decode_tok_s": decode_ceiling,
        "ceiling/actor_fwd_tok_s": train_rate / actor_flops_per_token(dims, shape),
        "ceiling/critic_fwd_tok_s": train_rate / critic_fwd_per_token,
        "ceiling/actor_train_tok_s": train_rate / actor_flops_per_token(dims, shape, train=True),
        "ceiling/critic_train_tok_s": train_rate / (3.0 * critic_fwd_per_token),
    }
    st = results.get("stages", {})
    if _ok(st):
        for kind, r in st.get("rollout", {}).items():
            if "tok_s" in r:
                out[f"fraction/rollout_{kind}"] = scaled(stat(r["tok_s"]), 1 / decode_ceiling)
        for role in ("actor_fwd", "critic_fwd"):
            if role in st:
                out[f"fraction/{role}"] = scaled(stat(st[role]["tok_s"]), 1 / out[f"ceiling/{role}_tok_s"])
    for role in ("actor", "critic"):
        if f"throughput/{role}_tok_s" in figures:
            out[f"fraction/{role}_train"] = scaled(
                figures[f"throughput/{role}_tok_s"], 1 / out[f"ceiling/{role}_train_tok_s"]
            )
    if "throughput/rollout_tok_s" in figures:
        out["fraction/rollout_in_step"] = scaled(figures["throughput/rollout_tok_s"], 1 / decode_ceiling)
    out.update(_sync_figures(c, results))
    return out


def _sync_figures(c: dict, results: dict) -> dict:
    """Sync bytes/s over memcpy bytes/s, per rank (sync/* are rank 0's; ranks copy at the same time)."""
    rows = [r for r in trainer_rows(results) if r.get("sync/seconds", 0) > 0 and r.get("sync/bytes", 0) > 0]
    if not rows:
        return {}
    memcpy = c["memcpy_bytes_per_s"]
    return {
        "fraction/sync_memcpy": stat([r["sync/bytes"] / r["sync/seconds"] / memcpy for r in rows]),
        "sync/memcpy_s": stat([r["sync/bytes"] / memcpy for r in rows]),
        "sync/memcpy_multiple": stat([r["sync/seconds"] * memcpy / r["sync/bytes"] for r in rows]),
    }


def floor_figures(results: dict, dims: ModelDims, shape: Optional[StepShape], figures: dict) -> dict:
    """The step's FLOP floor, its time at the ceilings, model FLOPs utilisation."""
    c = results.get("ceilings", {})
    if shape is None:
        return {}
    flops = step_flops(dims, shape)
    out = {"floor/flops": flops}
    if not _ok(c) or "timing/step_s" not in figures:
        return out
    train_rate, decode_rate = c["train_flops_per_s_total"], c["decode_flops_per_s_total"]
    floor_s = flops["generation"] / decode_rate + (flops["total"] - flops["generation"]) / train_rate
    step = figures["timing/step_s"]
    out["floor/seconds"] = floor_s
    out["floor/compute_only_seconds"] = flops["total"] / train_rate
    out["fraction/step_floor"] = over(floor_s, step)
    out["fraction/mfu"] = over(flops["total"] / train_rate, step)
    return out


# The measured times a trainer step reports, each against the phases of the byte model it spans.
ROOFLINE_GROUPS = (
    ("sync", "timing/sync_s", ("weight_sync",)),
    ("rollout", "timing/rollout_s", ("prefill", "decode")),
    ("update_forwards", "timing/update_forwards_s", ("old_logprob", "ref_logprob", "critic_values")),
    (
        "actor_update",
        "timing/actor_update_s",
        ("actor_train", "actor_optimizer", "actor_grad_collective", "actor_param_collective"),
    ),
    (
        "critic_update",
        "timing/critic_update_s",
        ("critic_train", "critic_optimizer", "critic_grad_collective", "critic_param_collective"),
    ),
    ("update", "timing/update_s", None),  # None: every phase of the update (all but sync and rollout)
    ("step", "timing/step_s", ()),  # (): every phase
)


def roofline_figures(results: dict, dims: ModelDims, shape: Optional[StepShape], figures: dict) -> dict:
    """Each phase's FLOP and byte floors and their max (the roofline, benchmarks/bytes.py); each measured
    time against the phases it spans (`fraction/<group>_roofline` = floor / measured)."""
    c = results.get("ceilings", {})
    if shape is None or not _ok(c) or "read_bytes_per_s" not in c:
        return {}
    layout = Layout.from_setup(results["setup"], results.get("model", {}))
    nbytes = step_bytes(dims, shape, layout)
    read_total = c["read_bytes_per_s"] * c.get("procs", 1)
    phases = roofline(
        phase_flops(dims, shape), nbytes, c["train_flops_per_s_total"], c["decode_flops_per_s_total"], read_total
    )
    out = {"roofline/phases": phases, "roofline/bytes": nbytes, "roofline/read_bytes_per_s_total": read_total}
    for group, key, names in ROOFLINE_GROUPS:
        if names == ():
            names = tuple(phases)
        elif names is None:
            names = tuple(p for p in phases if p not in ("weight_sync", "prefill", "decode"))
        present = [p for p in names if p in phases]
        if not present:
            continue
        floor = sum(phases[p]["floor_s"] for p in present)
        out[f"roofline/{group}_s"] = floor
        out[f"roofline/{group}_flop_s"] = sum(phases[p]["flop_s"] for p in present)
        if key in figures and floor > 0:
            out[f"fraction/{group}_roofline"] = over(floor, figures[key])
    out["roofline/seconds"] = out.pop("roofline/step_s")
    out.update(_forward_roofline(results, dims, shape, layout, c["train_flops_per_s_total"], read_total))
    return out


def _forward_roofline(results, dims, shape, layout, train_rate: float, read_rate: float) -> dict:
    """The actor-forward micro-benchmark (one compute_logprobs over the step's batch) against the
    roofline floor of one log-prob forward, whether or not the step itself runs one."""
    st = results.get("stages", {})
    if not _ok(st) or "actor_fwd" not in st:
        return {}
    floor = max(
        actor_forward_flops(dims, shape) / train_rate,
        forward_bytes(dims, shape, layout, dims.matmul_params, logits=True) / read_rate,
    )
    # tokens/s -> seconds for the batch: floor / (tokens / tok_s) = tok_s x floor / tokens
    share = scaled(stat(st["actor_fwd"]["tok_s"]), floor / shape.train_tokens)
    return {"roofline/actor_fwd_s": floor, "fraction/actor_fwd_roofline": share}


def trl_figures(results: dict) -> dict:
    trl = results.get("trl", {})
    if not _ok(trl):
        return {}
    s = results["setup"]
    rows = trl.get("steps", [])[s.get("warmup_steps", 1) :]
    gen = [r.get("trl/completions/mean_length", 0.0) * trl["prompts"] * trl["generations"] for r in rows]
    out = {
        "trl/step_s": stat([r["step_s"] for r in rows]),
        "trl/gen_tokens": stat(gen),
        "trl/gen_tok_s": stat([g / r["step_s"] for g, r in zip(gen, rows)]),
        "trl/peak_rss_gib": max(trl.get("memory", {}).get("sum_rss_gib", 0.0), trl.get("peak_rss_gib", 0.0)),
    }
    return {k: v for k, v in out.items() if v is not None}


def comparison_figures(figures: dict, results: dict) -> dict:
    """rlstack / TRL ratios (the same model, task, batch and lengths on the same machine)."""
    out = {}
    if "trl/step_s" in figures and "timing/step_s" in figures:
        out["ratio/step_time"] = figures["timing/step_s"]["median"] / figures["trl/step_s"]["median"]
    if figures.get("trl/gen_tok_s", {}).get("median") and "step/gen_tok_s" in figures:
        out["ratio/gen_tok_s"] = figures["step/gen_tok_s"]["median"] / figures["trl/gen_tok_s"]["median"]
    mem = results.get("trainer", {}).get("memory", {})
    if figures.get("trl/peak_rss_gib") and mem.get("sum_rss_gib"):
        out["ratio/peak_memory"] = mem["sum_rss_gib"] / figures["trl/peak_rss_gib"]
    return out


def training_state_bytes(results: dict) -> Optional[float]:
    """One rank's training state: params + fp32 grads + the optimizer's shard (Adam: 2 fp32 moments,
    plus fp32 master params when training in bf16), the parameters split over TP x PP, the optimizer
    state over DP with the distributed optimizer. Activations and the runtime are what the 1.3x allows."""
    s, m = results["setup"], results["model"]
    if "params" not in m:
        return None
    per_rank = m["params"] / (s.get("tp", 1) * s.get("pp", 1))
    param_bytes = 4 if s.get("dtype", "float32") == "float32" else 2
    optimizer = 8 + (0 if param_bytes == 4 else 4)
    shard = s.get("dp", 1) if s.get("distributed_optimizer") else 1
    return per_rank * (param_bytes + 4 + optimizer / shard)


def memory_figures(results: dict) -> dict:
    mem = results.get("trainer", {}).get("memory", {})
    state = training_state_bytes(results)
    out = {}
    if state:
        out["mem/state_gib_per_rank"] = state / GIB
        if mem.get("per_rank_rss_gib"):
            out["ratio/rank_memory_vs_state"] = max(mem["per_rank_rss_gib"]) / (state / GIB)
    return out


def layouts_agree(setup: dict) -> bool:
    """The rollout engine needs exactly what its rank's actor holds: one TP shard layout, no pipeline split."""
    return setup.get("rollout_tp", 1) == setup.get("tp", 1) and setup.get("pp", 1) == 1


def target_figures(figures: dict, setup: Optional[dict] = None) -> dict:
    """Each target: the measured value (median), the bound, and whether it is met."""
    sync_bytes = (figures.get("sync/bytes") or {}).get("median")
    measured = {
        "peak_memory_vs_trl": figures.get("ratio/peak_memory"),
        "rank_memory_vs_state": figures.get("ratio/rank_memory_vs_state"),
        "step_time_vs_trl": figures.get("ratio/step_time"),
        "step_time_vs_trl_every_cpu": figures.get("ratio/step_time"),
        "rollout_decode_fraction": (figures.get("fraction/rollout_in_step") or {}).get("median"),
        "step_floor_fraction": (figures.get("fraction/step_floor") or {}).get("median"),
        "step_roofline_fraction": (figures.get("fraction/step_roofline") or {}).get("median"),
        "sync_bytes": sync_bytes if layouts_agree(setup or {}) else None,
    }
    out = {}
    for name, (op, bound, text) in TARGETS.items():
        value = measured[name]
        met = None if value is None else (value <= bound if op == "<=" else value >= bound)
        out[name] = {"value": value, "op": op, "bound": bound, "text": text, "met": met}
    return out


def _derive_one(results: dict) -> dict:
    dims = ModelDims(**results["model"]["dims"])
    figures = trainer_figures(results)
    shape = step_shape(results, figures)
    figures.update(ceiling_figures(results, dims, shape, figures))
    figures.update(floor_figures(results, dims, shape, figures))
    figures.update(roofline_figures(results, dims, shape, figures))
    figures.update(trl_figures(results))
    figures.update(comparison_figures(figures, results))
    figures.update(memory_figures(results))
    figures["targets"] = target_figures(figures, results["setup"])
    if shape is not None:
        figures["shape"] = {
            "prompt_len": shape.prompt_len,
            "response_len": shape.response_len,
            "sequences": shape.num_sequences,
            "train_tokens": shape.train_tokens,
        }
    return figures


def setting_results(results: dict, name: str) -> dict:
    """The run as if only setting `name` had been run: its trainer and TRL parts, its reference flag."""
    st = results["settings"][name]
    setup = {**results["setup"], "reference": st.get("reference", results["setup"].get("reference", True))}
    if "prefix_sharing" in st:
        setup["prefix_sharing"] = st["prefix_sharing"]
    nproc = st.get("nproc")
    if nproc and nproc != setup["nproc"]:  # the same machine's threads over fewer ranks (data parallel only)
        threads = setup["nproc"] * setup["threads_per_rank"] // nproc
        dp = nproc // (setup.get("tp", 1) * setup.get("pp", 1))
        layout = f"tp{setup.get('tp', 1)} pp{setup.get('pp', 1)} dp{dp}"
        setup.update(nproc=nproc, threads_per_rank=threads, dp=dp, layout=layout)
    return {**results, "setup": setup, "trainer": st.get("trainer", {}), "trl": st.get("trl", {})}


def derive(results: dict) -> dict:
    """Figures of the primary setting at the top level; every setting's own under figures["settings"]."""
    figures = _derive_one(results)
    settings = results.get("settings") or {}
    figures["settings"] = {name: _derive_one(setting_results(results, name)) for name in settings}
    return figures
