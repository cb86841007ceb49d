"""Split placement layout checks (rlstack/parallel.py check_placement): one line naming the key and the fix."""

import pytest

from rlstack.config import ConfigError, load_config
from rlstack.errors import UserError
from rlstack.parallel import check_layout


def _cfg(*overrides):
    return load_config("yaml_configs/tiny_cpu.yaml", list(overrides))


def test_colocated_and_a_fitting_split_pass():
    assert check_layout(_cfg(), 2).dp == 2
    dims = check_layout(_cfg("placement.rollout_ranks=1", "rollout.staleness=1"), 2)
    assert (dims.tp, dims.pp, dims.dp, dims.world_size) == (1, 1, 1, 1)  # the training ranks' own layout
    # vLLM on the rollout ranks (TP 2 over two of them) with the post-sync probe
    split_vllm = ("placement.rollout_ranks=2", "rollout.engine=vllm", "rollout.tp=2", "rollout.verify_sync=1")
    assert check_layout(_cfg(*split_vllm), 4).dp == 2


@pytest.mark.parametrize(
    "overrides, world, words",
    [
        (("placement.rollout_ranks=2",), 2, "placement.rollout_ranks=2 leaves no training rank"),
        (("placement.rollout_ranks=1", "parallel.tp=2"), 4, "choose placement.rollout_ranks from [2]"),
        (("placement.rollout_ranks=1", "rollout.tp=2"), 4, "make placement.rollout_ranks a multiple of rollout.tp"),
        (("placement.rollout_ranks=1", "rollout.engine=vllm", "rollout.tp=2"), 3, "a multiple of rollout.tp"),
        (("rollout.staleness=1",), 2, "set placement.rollout_ranks=K > 0"),
        (("rollout.partial=true",), 2, "set placement.rollout_ranks=K > 0 and rollout.engine=hf"),
        (("placement.rollout_ranks=1", "rollout.engine=vllm", "rollout.partial=true"), 2, "rollout.partial=false"),
    ],
)
def test_layout_errors_name_the_fix(overrides, world, words):
    with pytest.raises(UserError) as e:
        check_layout(_cfg(*overrides), world)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "override, words",
    [
        ("placement.rollout_ranks=-1", "'placement.rollout_ranks' is -1"),
        ("rollout.staleness=-1", ">= 0 (0: synchronous"),
        ("algorithm.rollout_is=seq", "'algorithm.rollout_is' is 'seq'"),
        ("algorithm.rollout_is_cap=0", "'algorithm.rollout_is_cap' is 0.0"),
        ("rollout.partial_mask_older_than=-2", ">= -1 (-1: mask nothing)"),
    ],
)
def test_value_ranges(override, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        _cfg(override)


def test_stream_rounds_cover_the_largest_replica_share():
    from rlstack.config import RolloutConfig
    from rlstack.placement import stream_rounds

    cfg = RolloutConfig(n=4, micro_batch_size=32)  # 8 prompts per engine call
    assert stream_rounds(32, cfg, 1) == 4
    assert stream_rounds(33, cfg, 2) == 3  # shares 17 and 16: 3 calls of up to 8
    assert stream_rounds(1, cfg, 1) == 1


def test_streamed_parts_land_in_their_rows():
    from types import SimpleNamespace

    import torch

    from rlstack.step.split import fill_from_parts as _fill_from_parts

    gens = [object() for _ in range(3)]
    part_a = SimpleNamespace(old_logprob=torch.tensor([[1.0, 2.0]]), ref_logprob=None, old_values=None)
    part_b = SimpleNamespace(
        old_logprob=torch.tensor([[3.0, 4.0, 5.0], [6.0, 7.0, 8.0]]), ref_logprob=None, old_values=None
    )
    full = SimpleNamespace(tokens=torch.zeros(4, 3), old_logprob=None, ref_logprob=None, old_values=None)
    _fill_from_parts(full, gens, [([gens[2]], [0.0], part_a), ([gens[0], gens[1]], [0.0, 0.0], part_b)])
    expected = torch.tensor([[3.0, 4.0, 5.0], [6.0, 7.0, 8.0], [1.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(full.old_logprob, expected)
    assert full.ref_logprob is None
