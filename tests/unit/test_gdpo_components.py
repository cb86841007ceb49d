"""gdpo's per-row reward components from the reward function's results (rlstack.step.scoring)."""

import numpy as np
import pytest
import torch

from rlstack.errors import UserError
from rlstack.rewards.custom import ScoreResult
from rlstack.step.scoring import reward_components


def test_components_by_hand():
    results = [
        ScoreResult(1.0, {"acc": True, "format": 0.5}),
        ScoreResult(0.0, {"acc": False, "format": np.float32(0.25)}),  # numpy scalars count
        ScoreResult(0.0, timed_out=True),  # past the timeout: scored 0, every component 0
    ]
    out = reward_components(results, ["format", "acc", "score"], rows=4)
    want = torch.tensor([[0.5, 0.25, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert out.dtype == torch.float32 and torch.equal(out, want)  # row 3 is a filler row: 0


@pytest.mark.parametrize("extras,shown", [({"format": 1.0}, "no 'acc'"), ({"acc": "yes"}, "'acc'='yes'")])
def test_a_missing_or_non_numeric_key_is_one_line(extras, shown):
    with pytest.raises(UserError) as e:
        reward_components([ScoreResult(1.0, extras)], ["acc"], rows=1)
    message = str(e.value)
    assert shown in message and "algorithm.gdpo_reward_keys" in message and "\n" not in message
    assert "'score'" in message  # the keys the function did return
