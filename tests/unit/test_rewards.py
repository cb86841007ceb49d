"""Rule scorers (GSM8K strict/flexible, arith, copy) and custom reward files with verl's signature."""

import pytest

from rlstack.rewards import SCORERS, RewardScorer, gsm8k
from rlstack.rewards.custom import load_custom_reward


# ----------------------------------------------------------------------------- gsm8k


@pytest.mark.parametrize("text, strict, flexible", [
    ("She has 3 + 4 = 7 apples.\n#### 7", "7", "7"),
    ("The answer is 18.", None, "18"),  # no #### : strict finds nothing; the period is not a decimal
    ("#### 18\nSo wait, maybe 20", "18", "20"),  # strict: after ####; flexible: last number
    ("#### 3\nno, #### 4", "4", "4"),  # the last #### wins
    ("####18", "18", "18"),
    ("#### -5", "-5", "-5"),
    ("It is -12 degrees.", None, "-12"),
    ("7-5=2", None, "2"),  # a minus between digits is subtraction, not a sign
    ("#### 1,234", "1234", "1234"),
    ("He paid $1,080.50 in total. #### $1,080.50", "1080.50", "1080.50"),
    ("The answer is 2.5 cups", None, "2.5"),
    ("I do not know.", None, None),
    ("", None, None),
])
def test_extract_answer(text, strict, flexible):
    assert gsm8k.extract_answer(text, "strict") == strict
    assert gsm8k.extract_answer(text, "flexible") == flexible


def test_extract_answer_rejects_unknown_method():
    with pytest.raises(ValueError, match="'strict' or 'flexible'"):
        gsm8k.extract_answer("#### 1", "loose")


def test_gsm8k_strict_vs_flexible_scores():
    text = "Tom has 5 + 7 = 12 apples now, so the answer is 12."
    assert gsm8k.compute_score(text, "12") == 0.0  # strict is verl's default
    assert gsm8k.compute_score(text, "12", method="flexible") == 1.0
    assert gsm8k.compute_score(text + "\n#### 12", "12") == 1.0


@pytest.mark.parametrize("text, truth, expected", [
    ("#### -3", "-3", 1.0),
    ("#### 3", "-3", 0.0),
    ("#### 1,000", "1000", 1.0),
    ("#### 1000", "1,000", 1.0),
    ("#### 18.0", "18", 1.0),  # numbers compare by value
    ("#### 18", "18.00", 1.0),
    ("#### 2.50", "2.5", 1.0),
    ("#### 3.14", "3", 0.0),
    ("#### $18", "18", 1.0),
    ("#### 18.", "18", 1.0),  # a sentence period after the number
    ("no number at all", "18", 0.0),
    ("#### 18", "eighteen", 0.0),  # a non-numeric ground truth never matches
])
def test_gsm8k_numeric_comparison(text, truth, expected):
    assert gsm8k.compute_score(text, truth) == expected


def test_gsm8k_format_score_and_score_as_in_verl():
    assert gsm8k.compute_score("#### 5", "6", format_score=0.1) == 0.1  # answered, wrong
    assert gsm8k.compute_score("five", "6", format_score=0.1) == 0.0  # no answer at all
    assert gsm8k.compute_score("#### 6", "6", score=2.0) == 2.0
    # verl's positional call: compute_score(solution_str, ground_truth, method, format_score, score)
    assert gsm8k.compute_score("answer 6", "6", "flexible", 0.0, 1.0) == 1.0


# ----------------------------------------------------------------------------- arith and copy


@pytest.mark.parametrize("text, expected", [
    ("5 + 7 = 12. #### 12", 1.0),
    ("He has 12 apples now.", 1.0),  # flexible: the last number, no #### needed
    ("#### 12\nThat makes 12 apples.", 1.0),
    ("#### 12\nOops, 13 apples.", 1.0),  # strict answer right, last number wrong: still right
    ("#### 11\nOr rather 12.", 1.0),  # strict wrong, last number right
    ("#### 11", 0.0),
    ("He has 5 + 7 = 13 apples.", 0.0),
    ("no idea", 0.0),
])
def test_arith_scorer_is_flexible(text, expected):
    assert SCORERS["arith"](text, "12") == expected


@pytest.mark.parametrize("text, expected", [
    ("7", 1.0), ("7 7 7", 1.0), ("The digit is 7.", 1.0), ("7.0", 1.0),
    ("8 then 7", 0.0), ("", 0.0), ("seven", 0.0), ("-7", 0.0), ("77", 0.0),
])
def test_copy_scorer_reads_the_first_number(text, expected):
    assert SCORERS["copy"](text, "7") == expected


def test_registry_names():
    assert {"openai/gsm8k", "gsm8k", "arith", "copy"} <= set(SCORERS)
    scorer = RewardScorer()
    assert scorer.score("openai/gsm8k", "so 4. #### 4", "4") == 1.0
    assert scorer.score("gsm8k", "so 4.", "4") == 0.0  # strict by default
    assert scorer.score("arith", "so 4.", "4") == 1.0
    assert scorer.score("copy", "4", "4") == 1.0


def test_unknown_data_source_names_the_fix():
    scorer = RewardScorer()
    with pytest.raises(ValueError, match=r"data_source 'lighteval/MATH'.*data\.reward_fn_file"):
        scorer.score("lighteval/MATH", "x", "1")
    with pytest.raises(ValueError, match="data.reward_fn_file"):
        scorer.check_sources(["arith", "lighteval/MATH"])
    scorer.check_sources(["arith", "openai/gsm8k"])


# ----------------------------------------------------------------------------- custom reward files


CUSTOM = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    bonus = extra_info.get("bonus", 0.0) if extra_info else 0.0
    hit = solution_str.strip() == ground_truth
    return {"score": (1.0 if hit else 0.0) + bonus, "acc": hit, "source": data_source}

def as_float(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return len(solution_str) / 10

def returns_none(data_source, solution_str, ground_truth, extra_info=None):
    return None

def returns_dict_without_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}

def two_args(solution_str, ground_truth):
    return 1.0

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    return str(path)


def test_custom_reward_file_is_loaded_and_used(reward_file):
    scorer = RewardScorer(custom_file=reward_file)
    # the custom function wins over the built-in scorer, for any data_source
    assert scorer.score("openai/gsm8k", "#### 4", "4") == 0.0
    assert scorer.score("openai/gsm8k", " 4 ", "4") == 1.0
    assert scorer.score("anything/else", "4", "4", extra_info={"bonus": 0.5}) == 1.5
    scorer.check_sources(["anything/else"])  # no scorer needed: the custom fn covers it
    assert RewardScorer(reward_file, "as_float").score("x", "12345", "1") == 0.5


def test_custom_reward_bad_return_values(reward_file):
    with pytest.raises(ValueError, match="returns_none returned None: return a float"):
        RewardScorer(reward_file, "returns_none").score("x", "1", "1")
    with pytest.raises(ValueError, match="without 'score'"):
        RewardScorer(reward_file, "returns_dict_without_score").score("x", "1", "1")


def test_custom_reward_load_errors(reward_file, tmp_path):
    with pytest.raises(ValueError, match=r"reward file .*nope\.py does not exist: fix data\.reward_fn_file"):
        load_custom_reward(str(tmp_path / "nope.py"))
    with pytest.raises(ValueError, match=r"has no function 'score_it'.*data\.reward_fn_name"):
        load_custom_reward(reward_file, "score_it")
    with pytest.raises(ValueError, match="not a function"):
        load_custom_reward(reward_file, "NOT_A_FUNCTION")
    with pytest.raises(ValueError, match=r"two_args\(solution_str, ground_truth\).*use the signature "
                                         r"compute_score\(data_source, solution_str, ground_truth"):
        load_custom_reward(reward_file, "two_args")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ValueError, match=r"broken\.py failed to import \(ModuleNotFoundError"):
        load_custom_reward(str(broken))
