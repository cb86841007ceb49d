"""What a step's agent samples show: `trainer.rollout_data_dir` lines and the step's agent metrics.

Both are pure: the trainer hands them the step's samples (and the decoded texts and scores it
already has) and writes/logs what they return.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from typing import Optional

ROLLOUT_FILE = "{step}.jsonl"


def rollout_lines(
    samples: Sequence, inputs: Sequence[str], outputs: Sequence[str], scores: Sequence[float], step: int
) -> list[dict]:
    """One record per sample: verl's fields (input, output, score, step) and the token view."""
    assert len(samples) == len(inputs) == len(outputs) == len(scores), "one input, output and score per sample"
    return [
        {
            "input": text_in,
            "output": text_out,
            "score": float(score),
            "step": int(step),
            "prompt_ids": list(s.prompt_ids),
            "response_ids": list(s.response_ids),
            "response_mask": list(s.response_mask),
            "num_turns": int(s.num_turns),
            "finish_reason": s.finish_reason,
        }
        for s, text_in, text_out, score in zip(samples, inputs, outputs, scores)
    ]


def write_rollout_data(
    directory: str, step: int, samples: Sequence, inputs: Sequence[str], outputs: Sequence[str], scores: Sequence[float]
) -> str:
    """`directory/<step>.jsonl`, one line per sample (verl's `trainer.rollout_data_dir`); its path.

    Written to a temporary name and renamed, so a killed run never leaves half a file."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, ROLLOUT_FILE.format(step=step))
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for line in rollout_lines(samples, inputs, outputs, scores, step):
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def agent_metrics(samples: Sequence, prefix: str = "agent/") -> dict[str, float]:
    """Per-step agent metrics: turns (mean, max), tool calls and errors by kind (per sample and in
    all), the share of response tokens the loops inserted, and the share of each stop reason."""
    if not samples:
        return {}
    n = len(samples)
    turns = [s.num_turns for s in samples]
    tokens = sum(len(s.response_mask) for s in samples)
    inserted = sum(len(s.response_mask) - sum(s.response_mask) for s in samples)
    calls = sum(int(s.extra.get("tool_calls", 0)) for s in samples)
    errors: Counter = Counter()
    for s in samples:
        errors.update(s.extra.get("tool_errors") or {})
    metrics = {
        f"{prefix}num_turns/mean": sum(turns) / n,
        f"{prefix}num_turns/max": float(max(turns)),
        f"{prefix}tool_calls": float(calls),
        f"{prefix}tool_calls/mean": calls / n,
        f"{prefix}tool_errors": float(sum(errors.values())),
        f"{prefix}inserted_token_share": inserted / tokens if tokens else 0.0,
    }
    for kind, count in sorted(errors.items()):
        metrics[f"{prefix}tool_errors/{kind}"] = float(count)
    for reason, count in sorted(Counter(s.finish_reason for s in samples).items()):
        metrics[f"{prefix}finish_reason/{reason}"] = count / n
    rewards = [r for s in samples for r in (s.extra.get("tool_rewards") or [])]
    if rewards:
        metrics[f"{prefix}tool_reward/mean"] = sum(rewards) / len(rewards)
    return metrics


def reward_extra_info(extra_info: Optional[dict], sample) -> dict:
    """The row's extra_info with the loop's `extra` under "agent" (what the reward function gets)."""
    return {**(extra_info or {}), "agent": dict(sample.extra)}
