"""The agent row of `make bench` (benchmarks/agent.py) on the tiny model, one gloo rank: the
multi-turn and single-turn rollouts make the same policy tokens, the multi-turn one in one batched
engine call a turn, and the tool waits it reports are the ones its loop made."""

from types import SimpleNamespace

from tests.dist_utils import run_distributed

OPTS = SimpleNamespace(engine="hf", batch=4, prompt_len=5, turns=3, turn_tokens=2, tool_ids=3, tool_s=0.05, repeats=1)


def _measure(hf_dir):
    from benchmarks.agent import measure
    from megatron_bridge.parallel import init_distributed

    return measure(OPTS, hf_dir, init_distributed(1, 1))


def test_multi_and_single_turn_make_the_same_policy_tokens_on_the_tiny_model(tiny_llama):
    (out,) = run_distributed(_measure, 1, tiny_llama, timeout=120)
    assert out["policy_tokens"] == 4 * 3 * 2  # measure() asserts both paths made exactly these
    assert out["engine_calls"] == 3 and out["rows_per_engine_call"] == 4  # one batched engine call a turn
    waited = 2 * 0.05  # two tool turns, the trajectories' calls concurrent
    assert waited * 0.9 <= out["tool_share"] * out["policy_tokens"] / out["multi_tok_s"] < 2 * waited
    # the prompt, then each later turn only the last answer's final token and the 3 inserted ids: the
    # rest of the context is the KV the engine kept (whole contexts would be 5 + 10 + 15 tokens)
    assert out["prefill_ratio"] == (5 + 2 * (1 + 3)) / 5
    assert out["ratio"] > 0 and out["ratio"] == out["runs"][0]["ratio"]
