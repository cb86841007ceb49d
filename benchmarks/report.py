"""Render a benchmark run: the Markdown table, the JSON, the PNG chart, and the README's latest table.

`render_markdown(results, figures)` is pure (tested); `write_chart` needs matplotlib.
"""

from __future__ import annotations

import json
import os
from typing import Optional

README_START, README_END = "<!-- bench:cpu:start -->", "<!-- bench:cpu:end -->"
STAGES = (
    ("timing/sync_s", "sync (weights into the engine)"),
    ("timing/rollout_s", "rollout (generation)"),
    ("timing/score_s", "score (rewards, batch)"),
    ("timing/update_s", "update (log-probs, advantages, training)"),
    ("timing/other_s", "other"),
)


# ---------------------------------------------------------------- number formats


def fmt_num(x: Optional[float], unit: str = "", digits: int = 3) -> str:
    """3 significant digits with an SI prefix: 1.23 k, 45.6 M, 789 G."""
    if x is None:
        return "-"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.{digits}g} {prefix}{unit}".rstrip()
    return f"{x:.{digits}g} {unit}".rstrip()


def fmt_pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def fmt_stat(s: Optional[dict], unit: str = "", scale: float = 1.0) -> tuple[str, str]:
    """(median, 'min-max (n)') of a stat."""
    if not s:
        return "-", "-"
    spread = f"{fmt_num(s['min'] * scale)}–{fmt_num(s['max'] * scale)} (n={s['n']})"
    return fmt_num(s["median"] * scale, unit), spread


def fmt_gib(x: Optional[float]) -> str:
    return "-" if not x else f"{x:.2f} GiB"


# ---------------------------------------------------------------- tables


def _row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def _frac(figures: dict, key: str) -> str:
    s = figures.get(key)
    return "-" if not s else f"{fmt_pct(s['median'])} ({fmt_pct(s['min'])}–{fmt_pct(s['max'])})"


def main_table(results: dict, f: dict) -> list[str]:
    lines = [_row("figure", "median", "spread: min–max (n)", "ceiling", "share of ceiling"), _row(*["---"] * 5)]
    floor = f.get("floor/seconds")
    lines.append(
        _row(
            "**PPO/GRPO step time**",
            *fmt_stat(f.get("timing/step_s"), "s"),
            f"FLOP floor {fmt_num(floor, 's')}" if floor else "-",
            _frac(f, "fraction/step_floor"),
        )
    )
    roof = f.get("roofline/seconds")
    if roof is not None:
        lines.append(
            _row(
                "&nbsp;&nbsp;against its roofline floor (FLOPs and bytes, per phase)",
                "",
                "",
                f"roofline floor {fmt_num(roof, 's')}",
                _frac(f, "fraction/step_roofline"),
            )
        )
    for key, name in STAGES:
        lines.append(_row(f"&nbsp;&nbsp;{name}", *fmt_stat(f.get(key), "s"), "", ""))
    lines.append(
        _row("model FLOPs utilisation of the step", "", "", "matmul FLOP/s at model shapes", _frac(f, "fraction/mfu"))
    )
    stages = results.get("stages", {})
    for kind, r in (stages.get("rollout", {}) if isinstance(stages, dict) else {}).items():
        if "tok_s" in r:
            lines.append(
                _row(
                    f"rollout tokens/s, {kind} engine (micro-bench)",
                    *fmt_stat(_s(r["tok_s"]), "tok/s"),
                    fmt_num(f.get("ceiling/decode_tok_s"), "tok/s"),
                    _frac(f, f"fraction/rollout_{kind}"),
                )
            )
        else:
            lines.append(
                _row(f"rollout tokens/s, {kind} engine", "skipped", r.get("skipped", r.get("error", "")), "", "")
            )
    lines.append(
        _row(
            f"rollout tokens/s in the step ({results['setup'].get('engine', '?')})",
            *fmt_stat(f.get("throughput/rollout_tok_s"), "tok/s"),
            fmt_num(f.get("ceiling/decode_tok_s"), "tok/s"),
            _frac(f, "fraction/rollout_in_step"),
        )
    )
    if "rollout/decode_rows_mean" in f:  # the hf engine's counters: how full its decode steps ran
        lines.append(
            _row("&nbsp;&nbsp;decode steps of the rollout (rank 0)", *fmt_stat(f["rollout/decode_steps"]), "", "")
        )
        lines.append(
            _row(
                "&nbsp;&nbsp;rows a decode step carried, mean (rank 0); share still generating",
                *fmt_stat(f["rollout/decode_rows_mean"]),
                "",
                _frac(f, "rollout/decode_live_share"),
            )
        )
    lines += agent_rows(results.get("agent"))
    lines += agent_rows(results.get("agent_long"))
    for role, name in (("actor_fwd", "actor forward"), ("critic_fwd", "critic forward")):
        if isinstance(stages, dict) and role in stages:
            lines.append(
                _row(
                    f"{name} tokens/s (micro-bench)",
                    *fmt_stat(_s(stages[role]["tok_s"]), "tok/s"),
                    fmt_num(f.get(f"ceiling/{role}_tok_s"), "tok/s"),
                    _frac(f, f"fraction/{role}"),
                )
            )
    for role in ("actor", "critic"):
        if f"throughput/{role}_tok_s" in f:
            lines.append(
                _row(
                    f"{role} training tokens/s (fwd+bwd+step)",
                    *fmt_stat(f.get(f"throughput/{role}_tok_s"), "tok/s"),
                    fmt_num(f.get(f"ceiling/{role}_train_tok_s"), "tok/s"),
                    _frac(f, f"fraction/{role}_train"),
                )
            )
    lines.append(
        _row(
            "weight sync seconds (rank 0)",
            *fmt_stat(f.get("sync/seconds"), "s"),
            f"memcpy {fmt_stat(f.get('sync/memcpy_s'), 's')[0]}",
            _frac(f, "fraction/sync_memcpy"),
        )
    )
    lines.append(_row("weight sync bytes (rank 0)", *fmt_stat(f.get("sync/bytes"), "B"), "", ""))
    lines.append(_row("weight sync peak extra memory", *fmt_stat(f.get("sync/peak_extra_bytes"), "B"), "", ""))
    lines += _memory_rows(results, f)
    return lines


AGENT_GOAL = 0.8  # issue 35: a multi-turn rollout makes at least 80% of a single-turn one's tokens/s


def _pct_spread(runs: list[dict], key: str) -> str:
    values = [r[key] for r in runs]
    return f"{fmt_pct(min(values))}–{fmt_pct(max(values))} (n={len(values)})"


def agent_rows(a: Optional[dict]) -> list[str]:
    """The agent row (benchmarks/agent.py): multi-turn tokens/s as a share of single-turn's, the
    engine's part of it, and the share of the multi-turn rollout's time spent waiting on tools."""
    if not isinstance(a, dict) or not a:
        return []
    name = "agent rollout tokens/s, multi-turn / single-turn, same policy tokens (micro-bench)"
    if "ratio" not in a:
        return [_row(name, "skipped", a.get("skipped", a.get("error", "")), "", "")]
    runs = a["runs"]
    prompt = f" after {a['prompt_len']}-token prompts" if "prompt_len" in a else ""
    shape = (
        f"{a['batch']} rows x {a['turns']} turns x {a['turn_tokens']} tokens{prompt}, {a['turns'] - 1} tool "
        f"calls of {a['tool_s']:g} s inserting {a['tool_ids']} ids, {a['engine']} engine"
    )
    met = "yes" if a["ratio"] >= AGENT_GOAL else "no"
    return [
        _row(
            f"{name}: {shape}",
            fmt_pct(a["ratio"]),
            _pct_spread(runs, "ratio"),
            f"single-turn {fmt_num(a['single_tok_s'], 'tok/s')}; goal >= {fmt_pct(AGENT_GOAL)}",
            f"goal met: {met}",
        ),
        _row(
            "&nbsp;&nbsp;the same, engine seconds only (one engine call a turn"
            + (f"; tokens prefilled: {a['prefill_ratio']:.2g}x the single-turn's)" if "prefill_ratio" in a else ")"),
            fmt_pct(a["engine_ratio"]),
            _pct_spread(runs, "engine_ratio"),
            "",
            "",
        ),
        _row(
            "&nbsp;&nbsp;the same, process CPU seconds (steadier on a loaded machine; no tool waits)",
            fmt_pct(a["cpu_ratio"]) if "cpu_ratio" in a else "-",
            _pct_spread(runs, "cpu_ratio") if "cpu_ratio" in a else "-",
            "",
            "",
        ),
        _row(
            "&nbsp;&nbsp;share of the multi-turn rollout's time waiting on tools",
            fmt_pct(a["tool_share"]),
            _pct_spread(runs, "tool_share"),
            "",
            "",
        ),
    ]


def _s(values: list[float]) -> Optional[dict]:
    from benchmarks.analysis import stat

    return stat(values)


def _memory_rows(results: dict, f: dict) -> list[str]:
    from benchmarks.analysis import PHASES

    mem = results.get("trainer", {}).get("memory", {})
    per_rank = ", ".join(fmt_gib(x) for x in mem.get("per_rank_rss_gib", []))
    rows = [
        _row("peak memory per rank (RSS)", per_rank or "-", "", "", ""),
        _row(
            "peak memory, all ranks at once (RSS sum; PSS sum)",
            fmt_gib(mem.get("sum_rss_gib")),
            f"PSS {fmt_gib(mem.get('sum_pss_gib'))}",
            "",
            "",
        ),
    ]
    if f.get("mem/gpu_peak_gib"):
        rows.append(_row("peak GPU memory allocated (rank 0)", *fmt_stat(f["mem/gpu_peak_gib"], "GiB"), "", ""))
    for kind, what in (("peak_gib", "RSS"), ("gpu_peak_gib", "GPU allocated")):
        for phase in PHASES:
            if f.get(f"mem/{kind}/{phase}"):
                label = f"&nbsp;&nbsp;rank 0 peak in {phase} ({what})"
                rows.append(_row(label, *fmt_stat(f[f"mem/{kind}/{phase}"], "GiB"), "", ""))
    return rows


def run_notes(results: dict) -> list[str]:
    """A line per part that failed (its figures are missing or partial), and parts reused from a run."""
    notes = [
        f"- {part}: {results[part]['error']}"
        for part in ("stages", "ceilings", "agent", "agent_long")
        if isinstance(results.get(part), dict) and "error" in results[part]
    ]
    settings = results.get("settings") or {"": {"trainer": results.get("trainer"), "trl": results.get("trl")}}
    for name, st in settings.items():
        notes += [
            f"- {part}{f' ({name})' if name else ''}: {st[part]['error']}"
            for part in ("trainer", "trl")
            if isinstance(st.get(part), dict) and "error" in st[part]
        ]
    out = ["", "Failures (figures from these parts are missing or partial):", *notes] if notes else []
    if results.get("reused"):
        r = results["reused"]
        out += ["", f"Parts taken from an earlier run ({r['from']}): {', '.join(r['parts'])}."]
    return out


def _settings(results: dict, f: dict) -> list[tuple[str, dict, dict]]:
    """(name, the setting's results view, its figures) for each setting run; the primary alone for old runs."""
    from benchmarks.analysis import setting_results

    if not results.get("settings"):
        return [("", results, f)]
    return [
        (n, setting_results(results, n), f["settings"][n]) for n in results["settings"] if n in f.get("settings", {})
    ]


def what_each_side_did(results: dict) -> list[str]:
    """One line: the work both sides ran, so a reader can check that like is compared with like."""
    s = results["setup"]
    trl = next(
        (st["trl"] for st in (results.get("settings") or {"": results}).values() if "steps" in st.get("trl", {})),
        results.get("trl", {}),
    )
    if "steps" not in trl:
        return []
    threads = s["nproc"] * s["threads_per_rank"]
    layouts = "".join(
        f"; {name}: {st['nproc']} x {threads // st['nproc']}"
        for name, st in (results.get("settings") or {}).items()
        if st.get("nproc") and st["nproc"] != s["nproc"]
    )
    return [
        f"Both sides: {s['model_name']}, {s['dtype']}, {s['prompts']} prompts x {s['n']} samples, at most "
        f"{s['max_new_tokens']} new tokens, temperature as configured, one optimizer step per batch, micro-batch "
        f"{s.get('micro_batch_size', '?')} (TRL: per_device_train_batch_size {trl.get('micro_batch_size', '?')}), "
        f"gradient checkpointing {'on' if s.get('gradient_checkpointing') else 'off'} (TRL: "
        f"{'on' if trl.get('gradient_checkpointing') else 'off'}), {s['nproc'] * s['threads_per_rank']} CPU threads "
        f"in all (rlstack: {s['nproc']} ranks x {s['threads_per_rank']}{layouts}; TRL: one process x "
        f"{trl.get('threads', '?')}), host allocator {s.get('host_allocator', 'glibc')} "
        f"(TRL: {trl.get('host_allocator', 'glibc')}){_matmul_note(s)}. "
        "rlstack generates with its own engine and skips the old-log-prob forward on policy; TRL generates with "
        "transformers' generate()." + _sharing_note(s) + _precision_note(s),
        "",
    ]


def _sharing_note(setup: dict) -> str:
    """rlstack's training pass with the n samples of a prompt sharing its forward (model.prefix_sharing)."""
    if not setup.get("prefix_sharing"):
        return ""
    return (
        " rlstack trains each prompt's n samples with the prompt run once (model.prefix_sharing: the same "
        "gradient, rounding aside, on fewer FLOPs); TRL runs the prompt in each sample's row, as rlstack's "
        "`unshared` row does."
    )


def _matmul_note(setup: dict) -> str:
    """Which float32 CPU matmul kernel each side ran (torch ships both; rlstack picks, TRL takes torch's)."""
    kernel = setup.get("cpu_matmul")
    if not kernel or setup.get("dtype") != "float32":
        return ""
    return f", float32 matmuls on {kernel} (parallel.cpu_matmul; TRL: torch's default, MKL)"


def _engine_note(setup: dict) -> str:
    """How rlstack's hf engine generates in a bf16 row (rollout.dtype, as resolved on the machine)."""
    if setup.get("engine_dtype", "float32") == "bfloat16":
        return (
            "its hf rollout engine generates in bf16 (rollout.dtype=auto on a CPU with native bf16: its weights "
            "views of the actor's, 0 bytes synced; attention multiplied in fp32)."
        )
    return "its hf rollout engine generates in fp32 on CPU (the weight sync casts)."


def _precision_note(setup: dict) -> str:
    """What bf16 means on each side (benchmarks/run.py --bf16); nothing for fp32."""
    if setup.get("dtype", "float32") == "float32":
        return ""
    return (
        f" Precision: {setup['dtype']} mixed precision on both sides. rlstack: megatron's bf16 weights and "
        f"activations, fp32 grads, fp32 main params and Adam moments; {_engine_note(setup)} TRL: weights loaded in "
        "bf16 (`model_init_kwargs`) and `bf16=True` (GRPOConfig's default), generating in bf16, its AdamW updating "
        "the bf16 weights (no fp32 copy)."
    )


def trl_table(results: dict, f: dict) -> list[str]:
    rows = [(n, r, g) for n, r, g in _settings(results, f) if "steps" in r.get("trl", {})]
    if not rows:
        trl = results.get("trl", {})
        reason = trl.get("skipped") or trl.get("error") or "not run"
        return [f"TRL comparison skipped: {reason}"]
    name = f"TRL {rows[0][1]['trl'].get('trl_version', '?')} GRPOTrainer"
    lines = [
        *what_each_side_did(results),
        _row("same model, task, batch, lengths", "setting", "rlstack", name, "rlstack / TRL"),
        _row(*["---"] * 5),
    ]
    for setting, r, g in rows:
        label = (r.get("settings", {}).get(setting, {}).get("label") or "as configured") if setting else "as configured"
        mem = r.get("trainer", {}).get("memory", {})
        lines += [
            _row(
                "step time",
                label,
                fmt_stat(g.get("timing/step_s"), "s")[0],
                fmt_stat(g.get("trl/step_s"), "s")[0],
                _ratio(g.get("ratio/step_time")),
            ),
            _row(
                "generated tokens / step time",
                label,
                fmt_stat(g.get("step/gen_tok_s"), "tok/s")[0],
                fmt_stat(g.get("trl/gen_tok_s"), "tok/s")[0],
                _ratio(g.get("ratio/gen_tok_s")),
            ),
            _row(
                "peak memory, all processes (RSS)",
                label,
                fmt_gib(mem.get("sum_rss_gib")),
                fmt_gib(g.get("trl/peak_rss_gib")),
                _ratio(g.get("ratio/peak_memory")),
            ),
            # a LoRA setting (--lora) beside full training: the sync moves adapter bytes (TRL: no sync)
            _row("weight sync bytes (rank 0)", label, fmt_stat(g.get("sync/bytes"), "B")[0], "-", ""),
        ]
    return lines


def _ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _target_cell(t: dict) -> tuple[str, str]:
    met = "n/a" if t["met"] is None else ("yes" if t["met"] else "no")
    return ("-" if t["value"] is None else f"{t['value']:.3g}"), met


def targets_table(results: dict, f: dict) -> list[str]:
    """Issue 15's targets, measured in each setting (the same work for rlstack and TRL in each)."""
    settings = _settings(results, f)
    head = ["target", "bound"]
    for name, _, _ in settings:
        head += [f"measured{f' ({name})' if name else ''}", "met"]
    lines = [_row(*head), _row(*["---"] * len(head))]
    for key, t in f.get("targets", {}).items():
        cells = [t["text"], f"{t['op']} {t['bound']}"]
        for _, _, g in settings:
            cells += list(_target_cell(g.get("targets", {}).get(key, t)))
        lines.append(_row(*cells))
    state = f.get("mem/state_gib_per_rank")
    if state:
        lines += [
            "",
            f"Training state per rank (params + grads + optimizer shard, from the model's "
            f"{results['model'].get('params', 0) / 1e6:.1f} M parameters): {fmt_gib(state)}. "
            "Sync bytes count only where the engine's layout is the actor's (rollout TP = TP, no PP).",
        ]
    return lines


def ceilings_table(results: dict) -> list[str]:
    c = results.get("ceilings", {})
    if "train_flops_per_s" not in c:
        return [f"Ceilings not measured: {c.get('error', 'not run')}"]
    per, tot = "per rank", f"machine ({c['procs']} x {c['threads_per_proc']} threads)"
    return [
        _row("ceiling", per, tot),
        _row("---", "---", "---"),
        _row(
            "matmul at training shapes"
            + (f" (fastest kernel: {c['train_kernel']})" if "train_kernel" in c else " (F.linear)"),
            fmt_num(c["train_flops_per_s"], "FLOP/s"),
            fmt_num(c["train_flops_per_s_total"], "FLOP/s"),
        ),
        *[
            _row(f"&nbsp;&nbsp;kernel {k}", fmt_num(v, "FLOP/s"), fmt_num(v * c["procs"], "FLOP/s"))
            for k, v in c.get("train_by_kernel", {}).items()
        ],
        _row(
            f"decode pass over all weights, streamed (fastest kernel: {c.get('decode_kernel', 'F.linear')})",
            fmt_num(c["decode_flops_per_s"], "FLOP/s"),
            fmt_num(c["decode_flops_per_s_total"], "FLOP/s"),
        ),
        *[
            _row(f"&nbsp;&nbsp;kernel {k}", fmt_num(v, "FLOP/s"), fmt_num(v * c["procs"], "FLOP/s"))
            for k, v in c.get("decode_by_kernel", {}).items()
        ],
        *(
            [
                _row(
                    "matmul at decode shapes, one weight hot in cache (F.linear; not a decode ceiling)",
                    fmt_num(c["decode_hot_flops_per_s"], "FLOP/s"),
                    fmt_num(c["decode_hot_flops_per_s_total"], "FLOP/s"),
                )
            ]
            if "decode_hot_flops_per_s" in c
            else []
        ),
        *(
            [
                _row(
                    "memory read (sum of a large tensor; the byte floor's rate)"
                    + (
                        f"; decode weights {fmt_num(c['decode_weight_bytes'], 'B')} a step: "
                        f"{fmt_num(c['decode_weight_bytes'] / c['read_bytes_per_s'], 's')} at this rate"
                        if "decode_weight_bytes" in c
                        else ""
                    ),
                    fmt_num(c["read_bytes_per_s"], "B/s"),
                    fmt_num(c["read_bytes_per_s"] * c["procs"], "B/s"),
                )
            ]
            if "read_bytes_per_s" in c
            else []
        ),
        _row(
            "memcpy (bytes copied)",
            fmt_num(c["memcpy_bytes_per_s"], "B/s"),
            fmt_num(c["memcpy_bytes_per_s_total"], "B/s"),
        ),
    ]


def floor_table(f: dict) -> list[str]:
    flops = f.get("floor/flops")
    if not flops:
        return ["FLOP floor not computed (no prompt/response lengths)."]
    lines = [_row("pass", "FLOPs"), _row("---", "---")]
    lines += [_row(k, fmt_num(v, "FLOP")) for k, v in flops.items()]
    return lines


# Measured times against the phases they span (analysis.ROOFLINE_GROUPS), as the roofline table names them.
ROOFLINE_ROWS = (
    ("sync", "timing/sync_s", "weight sync"),
    ("rollout", "timing/rollout_s", "rollout (prefill + decode)"),
    ("update_forwards", "timing/update_forwards_s", "update: log-prob / value forwards, advantages"),
    ("actor_update", "timing/actor_update_s", "update: actor training (fwd + bwd, collectives, optimizer)"),
    ("critic_update", "timing/critic_update_s", "update: critic training"),
    ("update", "timing/update_s", "update, all of it"),
    ("step", "timing/step_s", "**step**"),
)


def roofline_table(f: dict) -> list[str]:
    """Each phase's FLOP and byte floors and the larger of the two; each measured time against its phases."""
    phases = f.get("roofline/phases")
    if not phases:
        return ["Roofline not computed (no lengths, or no memory read rate among the ceilings)."]
    lines = [
        f"Bytes at the machine's read rate ({fmt_num(f['roofline/read_bytes_per_s_total'], 'B/s')}, all ranks); "
        "FLOPs at the decode ceiling (prefill, decode) or the training matmul ceiling (the rest), as the "
        'FLOP floor. docs/benchmarks.md ("Byte floor") derives every count.',
        "",
        _row("phase", "FLOPs", "bytes (all ranks)", "FLOP floor", "byte floor", "roofline floor", "bound"),
        _row(*["---"] * 7),
    ]
    for name, p in phases.items():
        lines.append(
            _row(
                name,
                fmt_num(p["flops"], "FLOP"),
                fmt_num(p["bytes"], "B"),
                fmt_num(p["flop_s"], "s"),
                fmt_num(p["byte_s"], "s"),
                fmt_num(p["floor_s"], "s"),
                p["bound"],
            )
        )
    lines += ["", _row("measured", "median", "FLOP floor", "roofline floor", "roofline / measured"), _row(*["---"] * 5)]
    for group, key, label in ROOFLINE_ROWS:
        floor = f.get("roofline/seconds" if group == "step" else f"roofline/{group}_s")
        if floor is None or key not in f:
            continue
        lines.append(
            _row(
                label,
                fmt_stat(f[key], "s")[0],
                fmt_num(f.get(f"roofline/{group}_flop_s"), "s"),
                fmt_num(floor, "s"),
                _frac(f, f"fraction/{group}_roofline"),
            )
        )
    if "roofline/actor_fwd_s" in f:
        lines.append(
            _row(
                "actor log-prob forward over the batch (micro-bench)",
                "",
                "",
                fmt_num(f["roofline/actor_fwd_s"], "s"),
                _frac(f, "fraction/actor_fwd_roofline"),
            )
        )
    return lines


def render_markdown(results: dict, f: dict) -> str:
    s = results["setup"]
    out = [
        f"# rlstack benchmark: {results['config_name']} ({results['date']})",
        "",
        f"{s['model_name']}, {s['algorithm'].upper()}, {s['prompts']} prompts x {s['n']} samples x "
        f"{s['max_new_tokens']} max new tokens, {s['dtype']}, {s['nproc']} ranks ({s['layout']}) x "
        f"{s['threads_per_rank']} threads, rollout engine `{s['engine']}`. {s['steps']} steps, the first "
        f"{s['warmup_steps']} excluded; micro-benchmarks: {s['warmup_reps']} warm-up + {s['reps']} timed "
        "repetitions.",
        "",
        *main_table(results, f),
        *run_notes(results),
        "",
        "## Side by side with TRL",
        "",
        *trl_table(results, f),
        "",
        "## Targets",
        "",
        *targets_table(results, f),
        "",
        "## Machine ceilings",
        "",
        *ceilings_table(results),
        "",
        "## FLOP floor of one step",
        "",
        *floor_table(f),
        "",
        "## Roofline of one step: FLOP floor and byte floor per phase",
        "",
        *roofline_table(f),
        "",
        "## Machine and versions",
        "",
    ]
    out += [f"- {k}: {v}" for k, v in {**results["machine"], **results["versions"]}.items()]
    out += ["", f"Command: `{results['command']}`", ""]
    return "\n".join(out)


def readme_section(results: dict, f: dict, results_dir: str, name: str = "") -> str:
    """The latest CPU table for a README: main figures, TRL ratios, targets, and links to the full run.

    results_dir: the results folder relative to the README ("results" from benchmarks/README.md);
    name: the results' file stem there (default <config>-<date>).
    """
    s = results["setup"]
    name = name or f"{results['config_name']}-{results['date']}"
    return "\n".join(
        [
            f"Latest CPU run: `{results['command']}` on {results['machine'].get('cpu', '?')} "
            f"({results['machine'].get('logical cores', '?')} cores{_flags(results)}), {results['date']}; "
            f"{s['model_name']}, "
            f"{s['prompts']} prompts x {s['n']} samples x {s['max_new_tokens']} tokens, {s['nproc']} ranks. "
            f"Full table, machine and versions: [{name}.md]({results_dir}/{name}.md); "
            f"chart: [{name}.png]({results_dir}/{name}.png).",
            "",
            *_load_note(results),
            *main_table(results, f),
            "",
            *trl_table(results, f),
            "",
            *targets_table(results, f),
        ]
    )


def _flags(results: dict) -> str:
    """ ", flags avx2 fma ..." (environment.VECTOR_FLAGS present) where the run recorded them."""
    flags = results.get("machine", {}).get("cpu flags (vector, matrix)")
    return f", flags {flags}" if flags else ""


def _load_note(results: dict) -> list[str]:
    """The machine's load during the run and the parts taken from an earlier run: how far to trust the figures."""
    m = results.get("machine", {})
    start, end = m.get("load average (1, 5, 15 min) at start"), m.get("load average at end")
    lines = []
    if start or end:
        lines.append(
            f"Load average (1, 5, 15 min) at start {start}, at end {end}: on a shared machine other work "
            "slows every figure, ceilings included; read the spreads."
        )
    if results.get("reused"):
        r = results["reused"]
        lines.append(f"Parts taken from an earlier run ({os.path.basename(r['from'])}): {', '.join(r['parts'])}.")
    return [*lines, ""] if lines else []


def write_json(results: dict, figures: dict, path: str) -> None:
    with open(path, "w") as fh:
        json.dump({"results": results, "figures": figures}, fh, indent=1, default=str)


def update_readme(path: str, table_md: str) -> bool:
    """Replace the text between the bench markers of a README; False when the markers are absent."""
    if not os.path.isfile(path):
        return False
    with open(path) as fh:
        text = fh.read()
    if README_START not in text or README_END not in text:
        return False
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    with open(path, "w") as fh:
        fh.write(f"{head}{README_START}\n{table_md.strip()}\n{README_END}{tail}")
    return True


def write_chart(results: dict, f: dict, path: str) -> None:
    """Left: step time by stage (rlstack) next to TRL's step. Right: shares of the machine's ceilings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottom = 0.0
    for key, name in STAGES:
        value = (f.get(key) or {}).get("median", 0.0)
        left.bar("rlstack", value, bottom=bottom, label=name)
        bottom += max(value, 0.0)
    if f.get("trl/step_s"):
        left.bar(
            f"TRL {results.get('trl', {}).get('trl_version', '')}",
            f["trl/step_s"]["median"],
            color="grey",
            label="TRL step",
        )
    left.set_ylabel("seconds per step (median)")
    left.set_title("step time")
    left.legend(fontsize=8)
    names = [k for k in sorted(f) if k.startswith("fraction/") and isinstance(f[k], dict)]
    right.barh([n.split("/", 1)[1] for n in names], [100 * f[n]["median"] for n in names], color="tab:blue")
    right.set_xlabel("% of ceiling (median)")
    right.set_title("share of the machine's ceilings")
    fig.suptitle(f"{results['config_name']} {results['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
