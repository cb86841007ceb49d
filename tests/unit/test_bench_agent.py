"""The agent row of `make bench` (benchmarks/agent.py): its tool-wait sum and how the report renders
it (the measurement itself on the tiny model: tests/distributed/test_agent_bench.py)."""

import copy

import pytest

from benchmarks import analysis, report
from benchmarks.agent import union_seconds
from tests.unit.test_bench_report import _results

AGENT = {
    "ratio": 0.9,
    "engine_ratio": 0.95,
    "tool_share": 0.04,
    "cpu_ratio": 0.88,
    "prefill_ratio": 7.0,
    "single_tok_s": 1000.0,
    "multi_tok_s": 900.0,
    "runs": [
        {"ratio": 0.85, "engine_ratio": 0.9, "tool_share": 0.03, "cpu_ratio": 0.86},
        {"ratio": 0.95, "engine_ratio": 1.0, "tool_share": 0.05, "cpu_ratio": 0.9},
    ],
    "engine": "hf",
    "batch": 32,
    "turns": 4,
    "turn_tokens": 16,
    "tool_ids": 16,
    "tool_s": 0.02,
}


def test_tool_wait_is_the_union_of_the_waits():
    assert union_seconds([]) == 0.0
    assert union_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.2, 3.5)]) == pytest.approx(3.0)
    assert union_seconds([(5.0, 6.0), (0.0, 1.0)]) == pytest.approx(2.0)


def test_the_agent_row_is_in_the_table_with_its_goal():
    results = _results()
    results["agent"] = copy.deepcopy(AGENT)
    text = report.render_markdown(results, analysis.derive(results))
    assert "multi-turn / single-turn, same policy tokens (micro-bench): 32 rows x 4 turns x 16 tokens, 3 tool" in text
    assert "| 90.0% | 85.0%–95.0% (n=2) | single-turn 1 ktok/s; goal >= 80.0% | goal met: yes |" in text
    assert "| &nbsp;&nbsp;share of the multi-turn rollout's time waiting on tools | 4.0% | 3.0%–5.0% (n=2) |" in text
    assert "one engine call a turn; tokens prefilled: 7x the single-turn's) | 95.0% | 90.0%–100.0% (n=2) |" in text
    assert "(steadier on a loaded machine; no tool waits) | 88.0% | 86.0%–90.0% (n=2) |" in text
    results["agent"]["ratio"] = 0.7
    assert "goal met: no" in report.render_markdown(results, analysis.derive(results))
    results["agent"] = {"error": "agent rollout exit code 1 (log x)"}
    text = report.render_markdown(results, analysis.derive(results))
    assert "| skipped | agent rollout exit code 1 (log x) |" in text and "- agent: agent rollout exit code 1" in text
    del results["agent"]
    assert "multi-turn / single-turn" not in report.render_markdown(results, analysis.derive(results))
    # the second agent row (agent_long: 64-token turns) renders beside it with its own shape and goal
    results["agent_long"] = dict(copy.deepcopy(AGENT), turn_tokens=64, ratio=0.6, prompt_len=64)
    text = report.render_markdown(results, analysis.derive(results))
    shape = "32 rows x 4 turns x 64 tokens after 64-token prompts, 3 tool calls of 0.02 s inserting 16 ids"
    assert f"{shape}, hf engine | 60.0% |" in text
    assert "goal met: no" in text
