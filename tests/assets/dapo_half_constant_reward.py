"""A reward for the dynamic-sampling e2e test (tests/e2e/test_dynamic_sampling.py) on the tiny `copy`
task: prompts whose answer digit is even score 0 whatever the response (constant groups, dropped);
the others score 1 for a response whose text has an even length, else 0 (the group varies)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if int(str(ground_truth).strip()[-1]) % 2 == 0:
        return 0.0
    return float(len(solution_str) % 2 == 0)
