"""A Plan as a table (GiB per GPU: one row per role's tensor kind, one column per phase) or as JSON."""

from __future__ import annotations

import textwrap

from rlstack.planner.build import GIB, PHASES, Plan
from rlstack.planner.items import count

WIDTH = 100  # columns: the table and every line of the plan


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


def format_plan(plan: Plan) -> str:
    where = "host memory per rank" if plan.device == "cpu" else "per GPU"
    stage = f", pipeline stage {plan.stage} (the most loaded)" if plan.pp > 1 else ""
    lines = [
        f"memory plan: {plan.config_path or 'config'}; model {plan.arch} {count(plan.num_params)} params "
        f"({plan.model_source})",
        f"layout: world {plan.world_size} = tp{plan.tp} x pp{plan.pp} x dp{plan.dp}, {plan.dtype}, "
        f"{plan.device.upper()} {gib(plan.budget_bytes)} GiB{stage}",
        "",
        _table(plan, where),
        "",
        _kv_line(plan),
        _recompute_line(plan),
        _verdict(plan),
    ]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(_fit(line) for line in lines if line is not None)


def _fit(text: str) -> str:
    """A prose line wrapped to WIDTH (the table is laid out to fit already)."""
    if "\n" in text or len(text) <= WIDTH:
        return text
    return textwrap.fill(text, WIDTH, subsequent_indent="  ", break_on_hyphens=False)


def summarize_plan(plan: Plan) -> str:
    """One line before a launch: the peak, of what, and the verdict (the table: --plan)."""
    where = "host memory per rank" if plan.device == "cpu" else "GPU memory"
    verdict = "fits" if plan.fits else "does NOT fit (see --validate-only for the table and a setting that fits)"
    return (
        f"memory plan: peak {gib(plan.peak_bytes)} of {gib(plan.budget_bytes)} GiB {where} "
        f"({plan.peak_phase}): {verdict}"
    )


def _table(plan: Plan, where: str) -> str:
    cells_width = 9 * len(PHASES)
    label_width = min(max(len(f"{i.role:<10} {i.name}") for i in plan.items) + 4, WIDTH - cells_width)
    name_width = label_width - 11
    header = f"{'GiB ' + where:<{label_width}}" + "".join(f"{p:>9}" for p in PHASES)
    rows = [header, "-" * len(header)]
    for item in plan.items:
        cells = "".join(f"{_cell(item.at(p)):>9}" for p in PHASES)
        mark = " *" if item.transient else ""
        name = textwrap.wrap(item.name + mark, name_width - 1, break_on_hyphens=False) or [""]
        rows.append(f"{item.role:<10} {name[0]:<{name_width}}" + cells)
        rows += [f"{'':<10}   {more}" for more in name[1:]]  # a long name goes on below its figures
    rows.append("-" * len(header))
    total = "total (resident + largest temporaries *)"
    rows.append(f"{total:<{label_width}}" + "".join(f"{gib(plan.total(p)):>9}" for p in PHASES))
    return "\n".join(rows)


def _cell(nbytes: int) -> str:
    if not nbytes:
        return "-"
    return gib(nbytes) if nbytes >= 0.005 * GIB else "<0.01"


def _kv_line(plan: Plan) -> str:
    kv = plan.kv
    head = (
        f"KV cache need: {kv.num_seqs} seqs x {kv.max_model_len} tokens x {kv.per_token_bytes / 1024:.1f} KiB "
        f"= {gib(kv.need_bytes)} GiB"
    )
    if kv.recommended_share is None:
        return head
    return (
        head + f"; the vLLM share leaves {gib(kv.available_bytes)} GiB for it; "
        f"gpu_memory_utilization {kv.recommended_share} would hold the need + 10%"
    )


def _recompute_line(plan: Plan) -> str:
    other = "with" if not plan.recompute else "without"
    return (
        f"peak {other} activation recompute (model.gradient_checkpointing={str(not plan.recompute).lower()}): "
        f"{gib(plan.other_recompute_peak)} GiB"
    )


def _verdict(plan: Plan) -> str:
    unit = "GiB of host memory" if plan.device == "cpu" else "GiB"
    peak = f"peak {gib(plan.peak_bytes)} GiB of {gib(plan.budget_bytes)} {unit} ({plan.peak_phase})"
    if plan.fits:
        return peak + ": fits"
    if plan.suggestion:
        return peak + f": does not fit; {' '.join(plan.suggestion)} would fit (peak {gib(plan.suggestion_peak)} GiB)"
    return peak + (
        f": does not fit even with recompute, micro-batch 1, the distributed optimizer, the vLLM "
        f"share at its need and every offload switch (offload.*: {gib(plan.offload_peak)} GiB alone): "
        f"add GPUs (parallel.tp/pp)"
    )


def plan_to_dict(plan: Plan) -> dict:
    return {
        "config": plan.config_path,
        "model_source": plan.model_source,
        "arch": plan.arch,
        "num_params": plan.num_params,
        "device": plan.device,
        "dtype": plan.dtype,
        "layout": {"world_size": plan.world_size, "tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "stage": plan.stage},
        "budget_bytes": plan.budget_bytes,
        "items": [
            {"role": i.role, "name": i.name, "transient": i.transient, "bytes": {p: i.at(p) for p in PHASES}}
            for i in plan.items
        ],
        "phase_bytes": {p: plan.total(p) for p in PHASES},
        "peak_phase": plan.peak_phase,
        "peak_bytes": plan.peak_bytes,
        "peak_gib": round(plan.peak_bytes / GIB, 3),
        "allocator_peak_bytes": plan.allocator_peak(),
        "fits": plan.fits,
        "kv_cache": {
            "per_token_bytes": plan.kv.per_token_bytes,
            "num_seqs": plan.kv.num_seqs,
            "max_model_len": plan.kv.max_model_len,
            "need_bytes": plan.kv.need_bytes,
            "available_bytes": plan.kv.available_bytes,
            "recommended_share": plan.kv.recommended_share,
        },
        "recompute": plan.recompute,
        "other_recompute_peak_bytes": plan.other_recompute_peak,
        "suggestion": plan.suggestion,
        "suggestion_peak_bytes": plan.suggestion_peak,
        "offload_peak_bytes": plan.offload_peak,
        "notes": plan.notes,
    }
