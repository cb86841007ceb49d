"""PNG charts of a run from its metrics.jsonl.

    python -m rlstack.plot RUN_DIR [--out DIR]

Writes reward, KL, losses, validation accuracy, throughput and stage-time charts (those whose
metrics the run logged) to DIR (default RUN_DIR/plots) and prints each path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Optional

from rlstack.errors import UserError

METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class Chart:
    name: str  # file name without .png
    title: str
    ylabel: str
    keys: tuple[str, ...] = ()  # exact metric names
    prefix: str = ""  # or every metric starting with this
    subplots: bool = False  # one panel per metric (different scales)


CHARTS = (
    Chart("reward", "Reward (mean, band: +-std)", "reward", keys=("reward/mean",)),
    Chart("kl", "KL to the reference", "KL", keys=("actor/kl",)),
    Chart("losses", "Losses", "loss", keys=("actor/loss", "critic/loss"), subplots=True),
    Chart("val_accuracy", "Validation accuracy", "accuracy", prefix="val/accuracy"),
    Chart("throughput", "Throughput", "tokens/s", prefix="throughput/"),
    Chart("timing", "Stage time", "seconds", prefix="timing/"),
)


def read_metrics(path: str) -> list[dict]:
    """Rows sorted by step; a step logged twice (a resumed run) keeps its last row."""
    if not os.path.isfile(path):
        raise UserError(f"{path} not found: pass the run's trainer.output_dir, which holds {METRICS_FILE}")
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    by_step: dict[int, dict] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue  # a run killed mid-write leaves at most one partial last line
            raise UserError(f"{path} line {number} is not JSON: fix or delete that line")
        if not isinstance(row, dict) or "step" not in row:
            raise UserError(f"{path} line {number} has no 'step': each line must be a JSON object with a step")
        by_step[int(row["step"])] = row
    return [by_step[s] for s in sorted(by_step)]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that hold a number for `key`."""
    steps, values = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            steps.append(row["step"])
            values.append(float(value))
    return steps, values


def chart_keys(chart: Chart, rows: list[dict]) -> list[str]:
    present = sorted({k for row in rows for k in row})
    wanted = list(chart.keys) + [k for k in present if chart.prefix and k.startswith(chart.prefix)]
    return [k for k in dict.fromkeys(wanted) if series(rows, k)[0]]


def draw(chart: Chart, rows: list[dict], keys: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on clusters
    import matplotlib.pyplot as plt

    panels = len(keys) if chart.subplots else 1
    fig, axes = plt.subplots(panels, 1, figsize=(7, 3 * panels + 0.5), squeeze=False, sharex=True)
    for i, key in enumerate(keys):
        ax = axes[i if chart.subplots else 0][0]
        steps, values = series(rows, key)
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
        if key == "reward/mean":
            _std_band(ax, rows)
        ax.set_ylabel(chart.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1][0].set_xlabel("step")
    fig.suptitle(chart.title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _std_band(ax, rows: list[dict]) -> None:
    both = [
        (r["step"], float(r["reward/mean"]), float(r["reward/std"]))
        for r in rows
        if isinstance(r.get("reward/mean"), (int, float)) and isinstance(r.get("reward/std"), (int, float))
    ]
    if both:
        steps, means, stds = zip(*both)
        ax.fill_between(steps, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)], alpha=0.2)


def plot_run(run_dir: str, out_dir: Optional[str] = None) -> list[str]:
    """Write one PNG per chart with data; returns their paths."""
    rows = read_metrics(os.path.join(run_dir, METRICS_FILE))
    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for chart in CHARTS:
        keys = chart_keys(chart, rows)
        if keys:
            path = os.path.join(out_dir, chart.name + ".png")
            draw(chart, rows, keys, path)
            written.append(path)
    if not written:
        raise UserError(
            f"{os.path.join(run_dir, METRICS_FILE)} holds no plottable metrics "
            f"(reward/mean, actor/kl, actor/loss, val/accuracy, throughput/*, timing/*)"
        )
    return written


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlstack.plot", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's trainer.output_dir")
    parser.add_argument("--out", default=None, help="where PNGs go (default RUN_DIR/plots)")
    args = parser.parse_args(argv)
    try:
        paths = plot_run(args.run_dir, args.out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
