"""A custom reward function, in verl's signature: rlstack calls it once per generated response.

    data.reward_fn_file=examples/reward.py data.reward_fn_name=compute_score

`solution_str` is the decoded response, `ground_truth` the row's reward_model.ground_truth and
`extra_info` the row's extra_info. Return a number, or a dict with a "score" key: the other numeric
keys are logged as metrics (here `reward/answered`, the share of responses that hold a number).
Keyword arguments of every call come from data.reward_kwargs.
"""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None, partial_credit=0.1, **kwargs):
    numbers = re.findall(r"\d+", solution_str)
    if not numbers:
        return {"score": 0.0, "answered": 0.0}
    correct = numbers[-1] == str(ground_truth).strip()  # the last number in the response is the answer
    return {"score": 1.0 if correct else partial_credit, "answered": 1.0}
