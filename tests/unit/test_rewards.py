"""Rule scorers (GSM8K strict/flexible, arith, copy) and custom reward files with verl's signature."""

import pytest

from rlstack.errors import UserError
from rlstack.rewards import SCORERS, RewardScorer, Sample, extras_metrics, extras_sums, gsm8k
from rlstack.rewards import math as math_reward
from rlstack.rewards.custom import load_custom_reward

# ----------------------------------------------------------------------------- gsm8k, verl's reading

# Cases written from verl 0.9.1's verl/utils/reward_score/gsm8k.py (and checked against it once,
# 200k random strings, while writing rlstack/rewards/gsm8k.py): (text, strict answer, flexible answer).
LONG_TAIL = " and that is how the farmer counted the eggs again" * 7  # 350 characters


@pytest.mark.parametrize(
    "text, strict, flexible",
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "7", "7"),
        ("#### $18", None, "18"),  # "$" is not in verl's pattern: strict finds nothing
        ("####18", None, "18"),  # strict needs exactly "#### " (one space)
        ("####  18", None, "18"),  # two spaces: nothing either
        ("#### 18.", "18.", "18."),  # the trailing period is part of the answer
        ("The answer is 18.", None, "18."),
        ("#### 1,234", "1234", "1,234"),  # strict drops commas, flexible keeps them
        ("#### -5", "-5", "-5"),
        ("7-5=2", None, "2"),
        ("5-3", None, "-3"),  # flexible reads "-3": a minus glued to digits is a sign for verl
        ("#### １８", None, None),  # full-width digits are not [0-9]
        ("#### 18\nSo wait, maybe 20", "18", "20"),
        ("#### 3\nno, #### 4", "4", "4"),
        ("Hello, world.", None, ","),  # flexible's last run that is not "." is the comma
        ("...", None, "..."),
        ("I do not know.", None, "."),  # only "." runs: verl's loop ends on the first and returns it
        ("", None, None),
        ("#### 42" + LONG_TAIL, None, None),  # the #### is before the last 300 characters: unseen
        ("x" * 400 + "#### 42", "42", "42"),  # the tail is searched however long the text
    ],
)
def test_verl_extract_solution(text, strict, flexible):
    assert gsm8k.verl_extract_solution(text, "strict") == strict
    assert gsm8k.verl_extract_solution(text, "flexible") == flexible


def test_verl_window_is_the_last_300_characters():
    assert gsm8k.verl_extract_solution("#### 42" + "y" * 293) == "42"  # 300 chars exactly
    assert gsm8k.verl_extract_solution("#### 42" + "y" * 294) is None  # the first "#" is cut


@pytest.mark.parametrize(
    "text, truth, strict, flexible",
    [
        ("#### 18", "18", 1.0, 1.0),
        ("#### $18", "18", 0.0, 1.0),
        ("####18", "18", 0.0, 1.0),
        ("#### 18.", "18", 0.0, 0.0),  # "18." != "18"
        ("#### 18.0", "18", 0.0, 0.0),  # compared as strings, not numbers
        ("#### 1,000", "1000", 1.0, 0.0),  # flexible keeps the comma
        ("#### -3", "-3", 1.0, 1.0),
        ("#### 3", "-3", 0.0, 0.0),
        ("#### １８", "18", 0.0, 0.0),
        ("#### 42" + LONG_TAIL, "42", 0.0, 0.0),
        ("#### 18", 18, 0.0, 0.0),  # a non-string ground truth never equals the answer string
        ("#### 18", " 18", 0.0, 0.0),  # nor one with a space
    ],
)
def test_verl_scores(text, truth, strict, flexible):
    assert gsm8k.compute_score(text, truth) == strict
    assert gsm8k.compute_score(text, truth, method="flexible") == flexible
    assert SCORERS["openai/gsm8k"](text, truth) == strict
    assert SCORERS["gsm8k_flexible"](text, truth) == flexible


def test_verl_format_score_and_score():
    assert gsm8k.compute_score("#### 5", "6", format_score=0.1) == 0.1  # answered, wrong
    assert gsm8k.compute_score("five", "6", format_score=0.1) == 0.0  # no answer at all
    assert gsm8k.compute_score("#### 18.", "18", format_score=0.1) == 0.1
    assert gsm8k.compute_score("#### 6", "6", score=2.0) == 2.0
    # verl's positional call: compute_score(solution_str, ground_truth, method, format_score, score)
    assert gsm8k.compute_score("answer 6", "6", "flexible", 0.0, 1.0) == 1.0
    assert isinstance(gsm8k.compute_score("nothing", "6"), float)


def test_extract_rejects_unknown_method():
    with pytest.raises(ValueError, match="'strict' or 'flexible'"):
        gsm8k.verl_extract_solution("#### 1", "loose")
    with pytest.raises(ValueError, match="'strict' or 'flexible'"):
        gsm8k.lenient_extract_answer("#### 1", "loose")


# ----------------------------------------------------------------------------- gsm8k, lenient reading


@pytest.mark.parametrize(
    "text, strict, flexible",
    [
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
        ("#### 42" + LONG_TAIL, "42", "42"),  # the whole response is searched
        ("I do not know.", None, None),
        ("", None, None),
    ],
)
def test_lenient_extract_answer(text, strict, flexible):
    assert gsm8k.lenient_extract_answer(text, "strict") == strict
    assert gsm8k.lenient_extract_answer(text, "flexible") == flexible


@pytest.mark.parametrize(
    "text, truth, expected",
    [
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
    ],
)
def test_lenient_numeric_comparison(text, truth, expected):
    assert gsm8k.lenient_score(text, truth) == expected
    assert SCORERS["gsm8k_lenient"](text, truth) == expected


def test_lenient_strict_vs_flexible():
    text = "Tom has 5 + 7 = 12 apples now, so the answer is 12."
    assert SCORERS["gsm8k_lenient"](text, "12") == 0.0
    assert SCORERS["gsm8k_lenient_flexible"](text, "12") == 1.0
    assert SCORERS["gsm8k_lenient"](text + "\n#### 12", "12") == 1.0


# ----------------------------------------------------------------------------- MATH, verl's reading


@pytest.mark.parametrize(
    "text, truth, expected",
    [
        ("so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),  # dfrac -> frac, \frac12 -> \frac{1}{2}
        ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),  # a/b of integers -> \frac{a}{b}
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{x = 3}", "3", 1.0),  # a short "x =" prefix is dropped
        ("\\boxed{10\\text{ cm}}", "10", 1.0),  # a right-hand unit is dropped
        ("\\boxed{90^\\circ}", "90", 1.0),
        ("\\boxed{\\sqrt3}", "\\sqrt{3}", 1.0),
        ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
        ("\\boxed{.5}", "0.5", 1.0),  # ".5" -> "0.5" -> \frac{1}{2}, as the truth "0.5" does
        ("first \\boxed{1} then \\boxed{2}", "2", 1.0),  # the last box
        ("\\boxed{{1}", "1", 0.0),  # never closed
        ("\\fbox{1}", "1", 0.0),  # found, but verl only unboxes \boxed{
        ("\\boxed 7$ and more", "7", 1.0),  # "\boxed " form: up to the next $
        ("The answer is 7.", "7", 0.0),  # no box
        ("\\boxed{1\\text{ a}\\text{ b}}", "1\\text{ a}\\text{ b}", 1.0),  # unnormalisable: raw equality
        ("\\boxed{3}", 3, 0.0),  # a ground truth that is not a string never matches
    ],
)
def test_math_scores_as_verl(text, truth, expected):
    assert math_reward.compute_score(text, truth) == expected
    assert SCORERS["lighteval/MATH"](text, truth) == expected
    assert SCORERS["HuggingFaceH4/MATH-500"](text, truth) == expected


def test_math_normalisation_failures_fall_back_to_raw_equality():
    with pytest.raises(ValueError):
        math_reward.normalize("\\sqrt")
    with pytest.raises(ValueError):
        math_reward.normalize("1\\text{ a}\\text{ b}")
    assert math_reward.is_equiv("\\frac", "\\frac") and not math_reward.is_equiv("\\frac", "\\frac ")
    assert "math" not in SCORERS  # verl scores data_source "math" with math_dapo, not ported


# ----------------------------------------------------------------------------- arith and copy


@pytest.mark.parametrize(
    "text, expected",
    [
        ("5 + 7 = 12. #### 12", 1.0),
        ("He has 12 apples now.", 1.0),  # flexible: the last number, no #### needed
        ("#### 12\nThat makes 12 apples.", 1.0),
        ("#### 12\nOops, 13 apples.", 1.0),  # strict answer right, last number wrong: still right
        ("#### 11\nOr rather 12.", 1.0),  # strict wrong, last number right
        ("#### 11", 0.0),
        ("He has 5 + 7 = 13 apples.", 0.0),
        ("no idea", 0.0),
    ],
)
def test_arith_scorer_is_flexible(text, expected):
    assert SCORERS["arith"](text, "12") == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("7", 1.0),
        ("7 7 7", 1.0),
        ("The digit is 7.", 1.0),
        ("7.0", 1.0),
        ("8 then 7", 0.0),
        ("", 0.0),
        ("seven", 0.0),
        ("-7", 0.0),
        ("77", 0.0),
    ],
)
def test_copy_scorer_reads_the_first_number(text, expected):
    assert SCORERS["copy"](text, "7") == expected


def test_registry_names():
    assert {
        "openai/gsm8k",
        "gsm8k",
        "gsm8k_flexible",
        "gsm8k_lenient",
        "gsm8k_lenient_flexible",
        "arith",
        "copy",
    } <= set(SCORERS)
    scorer = RewardScorer()
    assert scorer.score("openai/gsm8k", "so 4. #### 4", "4") == 1.0
    assert scorer.score("gsm8k", "so 4.", "4") == 0.0  # strict by default
    assert scorer.score("openai/gsm8k", "####4", "4") == 0.0  # verl's reading
    assert RewardScorer(builtin="gsm8k_lenient").score("openai/gsm8k", "####4", "4") == 1.0
    assert scorer.score("arith", "so 4.", "4") == 1.0
    assert scorer.score("copy", "4", "4") == 1.0


def test_unknown_data_source_names_the_fix():
    scorer = RewardScorer()
    with pytest.raises(UserError, match=r"data_source 'math_dapo'.*data\.reward_fn_file"):
        scorer.score("math_dapo", "x", "1")
    with pytest.raises(ValueError, match="data.reward_fn_file"):
        scorer.check_sources(["arith", "math_dapo"])
    scorer.check_sources(["arith", "openai/gsm8k"])


# ----------------------------------------------------------------------------- custom reward files


CUSTOM = """
import math, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    bonus = extra_info.get("bonus", 0.0) if extra_info else 0.0
    hit = solution_str.strip() == ground_truth
    return {"score": (1.0 if hit else 0.0) + bonus, "acc": hit, "source": data_source}

def with_kwargs(data_source, solution_str, ground_truth, extra_info=None, scale=1.0, **kwargs):
    return {"score": scale * len(solution_str), "n_kwargs": len(kwargs)}

def as_float(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return len(solution_str) / 10

def returns_none(data_source, solution_str, ground_truth, extra_info=None):
    return None

def returns_nan(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan")

def returns_inf(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": -math.inf}

def returns_str(data_source, solution_str, ground_truth, extra_info=None):
    return "1.0"

def returns_dict_without_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}

def raises(data_source, solution_str, ground_truth, extra_info=None):
    return int(solution_str)  # ValueError on words

def slow(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "slow":
        time.sleep(5)
    return 1.0

async def coro(data_source, solution_str, ground_truth, extra_info=None):
    return 0.25

def batched(data_sources, solution_strs, ground_truths, extra_infos, offset=0.0, **kwargs):
    return [{"score": float(s == g) + offset, "len": len(s)} if d == "dict" else float(s == g) + offset
            for d, s, g in zip(data_sources, solution_strs, ground_truths)]

def batched_short(data_sources, solution_strs, ground_truths, extra_infos):
    return [1.0]

def two_args(solution_str, ground_truth):
    return 1.0

NOT_A_FUNCTION = 3
"""


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
    assert RewardScorer(reward_file, "coro").score("x", "1", "1") == 0.25  # async def is awaited


def test_dict_result_extras_are_returned_and_become_metrics(reward_file):
    scorer = RewardScorer(custom_file=reward_file)
    results = scorer.score_batch([Sample("src", "4", "4"), Sample("src", "5", "4"), Sample("src", "4", "4")])
    assert [r.score for r in results] == [1.0, 0.0, 1.0]
    assert results[0].extras == {"acc": True, "source": "src"}
    metrics = extras_metrics(results)
    # numeric extras (bools count) averaged; the string "source" is not a metric
    assert metrics == {"reward_extra/acc": pytest.approx(2 / 3), "reward_extra/timed_out": 0.0}
    assert extras_sums(results)["reward_extra/acc"] == (2.0, 3)  # what to all-reduce over ranks


def test_reward_kwargs_are_passed_through(reward_file):
    scorer = RewardScorer(reward_file, "with_kwargs", reward_kwargs={"scale": 2.0, "other": "x"})
    result = scorer.score_batch([Sample("s", "abc", "")])[0]
    assert result.score == 6.0 and result.extras == {"n_kwargs": 1}


def test_reward_timeout_scores_zero_and_is_counted(reward_file):
    scorer = RewardScorer(reward_file, "slow", timeout_s=0.2)
    import time

    start = time.perf_counter()
    results = scorer.score_batch([Sample("s", "slow", ""), Sample("s", "fast", "")])
    assert time.perf_counter() - start < 2.0
    assert [(r.score, r.timed_out) for r in results] == [(0.0, True), (1.0, False)]
    assert extras_metrics(results)["reward_extra/timed_out"] == 0.5


def test_reward_timeout_off_the_main_thread(reward_file):
    import threading

    box = {}
    scorer = RewardScorer(reward_file, "slow", timeout_s=0.2)
    worker = threading.Thread(target=lambda: box.update(r=scorer.score_batch([Sample("s", "slow", "")])))
    worker.start()
    worker.join(3.0)
    assert box["r"][0].timed_out


def test_batched_reward_function(reward_file):
    scorer = RewardScorer(reward_file, "batched", batched=True, reward_kwargs={"offset": 0.5})
    results = scorer.score_batch([Sample("dict", "a", "a"), Sample("plain", "a", "b"), Sample("dict", "xy", "z")])
    assert [r.score for r in results] == [1.5, 0.5, 0.5]
    assert [r.extras for r in results] == [{"len": 1}, {}, {"len": 2}]
    assert scorer.score_batch([]) == []
    with pytest.raises(UserError, match=r"batched_short .* returned 1 results for a batch of 2 samples"):
        RewardScorer(reward_file, "batched_short", batched=True).score_batch(
            [Sample("s", "a", "a", row=1), Sample("s", "b", "b", row=2)]
        )
    with pytest.raises(UserError, match=r"cannot be called as verl calls it.*data\.reward_fn_batched=false"):
        RewardScorer(reward_file, "compute_score", batched=True)
    with pytest.raises(UserError, match=r"data\.reward_fn_batched=true"):
        RewardScorer(reward_file, "batched")  # the batched form without the flag
    with pytest.raises(UserError, match="needs data.reward_fn_file"):
        RewardScorer(batched=True)


@pytest.mark.parametrize(
    "name, shown",
    [
        ("returns_none", "None"),
        ("returns_nan", "nan"),
        ("returns_inf", "-inf"),
        ("returns_str", "'1.0'"),
    ],
)
def test_bad_scores_stop_with_source_row_and_function(reward_file, name, shown):
    scorer = RewardScorer(reward_file, name)
    with pytest.raises(UserError) as info:
        scorer.score("openai/gsm8k", "1", "1", row=17)
    message = str(info.value)
    assert "\n" not in message
    assert f"reward function {name} in {reward_file} returned score {shown}" in message
    assert "data_source 'openai/gsm8k', row 17" in message


def test_dict_without_score_stops(reward_file):
    with pytest.raises(UserError, match=r"without 'score' \(keys: \['acc'\]\) for data_source 'x', row 3"):
        RewardScorer(reward_file, "returns_dict_without_score").score("x", "1", "1", row=3)


def test_raising_reward_function_is_chained(reward_file):
    with pytest.raises(UserError) as info:
        RewardScorer(reward_file, "raises").score("src", "four", "4", row=5)
    message = str(info.value)
    assert message.startswith(f"reward function raises in {reward_file} raised ValueError: invalid literal")
    assert "data_source 'src', row 5" in message and "\n" not in message
    assert isinstance(info.value.__cause__, ValueError)  # the original traceback stays reachable


def test_builtin_scorer_choice(reward_file):
    with pytest.raises(UserError, match="data.reward_scorer='nope' is not a built-in scorer"):
        RewardScorer(builtin="nope")
    scorer = RewardScorer(builtin="gsm8k_lenient")
    scorer.check_sources(["math_dapo"])  # one scorer for every source
    assert scorer.score("math_dapo", "#### 18.0", "18") == 1.0


def test_scorer_from_config(reward_file):
    from rlstack.config import load_config

    cfg = load_config(
        None,
        [
            "data.synthetic=arith",
            f"data.reward_fn_file={reward_file}",
            "data.reward_fn_name=with_kwargs",
            "data.reward_kwargs.scale=3",
            "data.reward_timeout_s=2",
        ],
    )
    assert cfg.data.reward_kwargs == {"scale": 3}
    scorer = RewardScorer.from_config(cfg.data)
    assert scorer.timeout_s == 2.0 and scorer.score("s", "ab", "") == 6.0
    from rlstack.config import ConfigError

    with pytest.raises(ConfigError, match="'data.reward_kwargs' expects a mapping"):
        load_config(None, ["data.synthetic=arith", "data.reward_kwargs=3"])
    with pytest.raises(ConfigError, match="'data.reward_scorer' is 'nope'"):
        load_config(None, ["data.synthetic=arith", "data.reward_scorer=nope"])


def test_custom_reward_load_errors(reward_file, tmp_path):
    with pytest.raises(UserError, match=r"reward file .*nope\.py does not exist: fix data\.reward_fn_file"):
        load_custom_reward(str(tmp_path / "nope.py"))
    with pytest.raises(UserError, match=r"has no function 'score_it'.*data\.reward_fn_name"):
        load_custom_reward(reward_file, "score_it")
    with pytest.raises(UserError, match="not a function"):
        load_custom_reward(reward_file, "NOT_A_FUNCTION")
    with pytest.raises(
        UserError,
        match=r"two_args\(solution_str, ground_truth\).*use the signature "
        r"compute_score\(data_source, solution_str, ground_truth",
    ):
        load_custom_reward(reward_file, "two_args")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(UserError, match=r"broken\.py failed to import \(ModuleNotFoundError"):
        load_custom_reward(str(broken))


def test_extras_from_several_ranks_merge_by_sums(reward_file):
    from rlstack.rewards import merge_extras_sums

    scorer = RewardScorer(custom_file=reward_file)
    rank0 = extras_sums(scorer.score_batch([Sample("s", "4", "4"), Sample("s", "5", "4")]))
    rank1 = extras_sums(scorer.score_batch([Sample("s", "4", "4")]))
    assert merge_extras_sums([rank0, rank1]) == {
        "reward_extra/acc": pytest.approx(2 / 3),
        "reward_extra/timed_out": 0.0,
    }
    assert merge_extras_sums([{}, rank1]) == {"reward_extra/acc": 1.0, "reward_extra/timed_out": 0.0}
