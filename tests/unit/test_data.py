"""Prompt rows (verl schema), datasets, samplers, synthetic tasks and the bad-data messages."""

import copy
import json
import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlstack.config import DataConfig
from rlstack.data import synthetic
from rlstack.data.dataset import PromptDataset, PromptSampler, build_datasets, val_accuracy, val_batches
from rlstack.data.rows import load_rows, write_jsonl, write_parquet

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    from megatron_bridge.tiny import make_tiny_tokenizer

    return make_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def verl_rows(n=6):
    """GSM8K-shaped rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} plus {i + 1}? Let's think step by step."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
            "extra_info": {
                "split": "train",
                "index": i,
                "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}",
                "question": f"What is {i} plus {i + 1}?",
            },
        }
        for i in range(n)
    ]


# ----------------------------------------------------------------------------- rows


def test_verl_rows_round_trip_parquet_and_jsonl(tmp_path):
    rows = verl_rows()
    write_parquet(rows, str(tmp_path / "d.parquet"))
    write_jsonl(rows, str(tmp_path / "d.jsonl"))
    assert load_rows([str(tmp_path / "d.parquet")]) == rows
    assert load_rows([str(tmp_path / "d.jsonl")]) == rows
    # the parquet file has verl's nested column types, readable by any parquet reader
    schema = pq.read_schema(str(tmp_path / "d.parquet"))
    assert pa.types.is_list(schema.field("prompt").type)
    assert pa.types.is_struct(schema.field("reward_model").type)


def test_optional_fields_are_filled_and_empty_extra_info_round_trips(tmp_path):
    rows = [
        {
            "data_source": "s",
            "prompt": [{"role": "user", "content": "hi"}],
            "reward_model": {"style": "rule", "ground_truth": "1"},
            "extra_info": {},
        }
    ]
    write_parquet(rows, str(tmp_path / "d.parquet"))  # parquet cannot hold an empty struct
    loaded = load_rows([str(tmp_path / "d.parquet")])
    assert loaded == [dict(rows[0], ability="")]


def test_json_array_file_and_several_files_in_order(tmp_path):
    rows = verl_rows(4)
    (tmp_path / "a.json").write_text(json.dumps(rows[:2]))
    write_jsonl(rows[2:], str(tmp_path / "b.jsonl"))
    assert load_rows([str(tmp_path / "a.json"), str(tmp_path / "b.jsonl")]) == rows


def test_jsonl_and_parquet_give_identical_batches(tmp_path, tok):
    rows = verl_rows(12)
    write_parquet(rows, str(tmp_path / "d.parquet"))
    write_jsonl(rows, str(tmp_path / "d.jsonl"))
    datasets = [
        PromptDataset(load_rows([str(tmp_path / name)]), tok, max_prompt_length=128)
        for name in ("d.parquet", "d.jsonl")
    ]
    batches = []
    for dataset in datasets:
        sampler = PromptSampler(len(dataset), batch_size=4, seed=3)
        batches.append([[dataset[i] for i in sampler.next_batch()] for _ in range(5)])
    assert batches[0] == batches[1]
    assert batches[0][0][0].ground_truth == rows[batches[0][0][0].index]["reward_model"]["ground_truth"]


# ----------------------------------------------------------------------------- dataset


def test_prompts_use_the_chat_template(tok):
    rows = verl_rows(2)
    dataset = PromptDataset(rows, tok, max_prompt_length=128)
    expected = tok.apply_chat_template(rows[1]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
    p = dataset[1]
    assert p.input_ids == list(expected)
    assert (p.index, p.data_source, p.ground_truth) == (1, "openai/gsm8k", "3")
    assert p.extra_info["index"] == 1
    assert tok.decode(p.input_ids).endswith("<|im_start|>assistant\n")
    assert dataset.data_sources() == ["openai/gsm8k"]


def test_system_prompt_only_when_rows_have_none(tok):
    rows = verl_rows(1)
    with_system = PromptDataset(rows, tok, 256, system_prompt="Be brief.")
    assert tok.decode(with_system[0].input_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    own = [dict(rows[0], prompt=[{"role": "system", "content": "Own."}] + rows[0]["prompt"])]
    text = tok.decode(PromptDataset(own, tok, 256, system_prompt="Be brief.")[0].input_ids)
    assert "Own." in text and "Be brief." not in text


def test_tokenizer_without_chat_template_is_an_error(tok):
    plain = copy.copy(tok)
    plain.chat_template = None
    with pytest.raises(ValueError, match="row 0 of the given rows.*use an instruct/chat model"):
        PromptDataset(verl_rows(1), plain, 128)


def test_data_modules_do_not_import_torch():
    code = (
        "import sys, rlstack.data.dataset, rlstack.data.make_arith, rlstack.rewards; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_too_long_prompt_errors_naming_file_row_and_fix(tmp_path, tok):
    rows = verl_rows(4)
    rows[2]["prompt"][0]["content"] = "many words " * 40
    path = str(tmp_path / "long.parquet")
    write_parquet(rows, path)
    with pytest.raises(
        ValueError,
        match=rf"data file {re.escape(path)} row 2: prompt is \d+ tokens.*max_prompt_length=64: "
        r"raise data.max_prompt_length or set data.truncation=drop",
    ):
        PromptDataset(load_rows([path]), tok, max_prompt_length=64)


def test_too_long_prompts_are_dropped_and_counted(tok):
    rows = verl_rows(5)
    rows[1]["prompt"][0]["content"] = "many words " * 40
    rows[3]["prompt"][0]["content"] = "many words " * 40
    dataset = PromptDataset(rows, tok, max_prompt_length=64, truncation="drop")
    assert dataset.num_dropped == 2 and len(dataset) == 3
    assert [p.index for p in dataset.prompts] == [0, 2, 4]
    assert all(len(p.input_ids) <= 64 for p in dataset.prompts)
    with pytest.raises(ValueError, match="all 5 prompts are longer"):
        PromptDataset(rows, tok, max_prompt_length=8, truncation="drop")


def test_build_datasets_synthetic(tok):
    cfg = DataConfig(synthetic="arith", synthetic_train_size=40, synthetic_val_size=10, seed=1)
    train, val = build_datasets(cfg, tok)
    assert (len(train), len(val)) == (40, 10)
    assert train.data_sources() == val.data_sources() == ["arith"]
    again, _ = build_datasets(cfg, tok)
    assert [p.input_ids for p in again.prompts] == [p.input_ids for p in train.prompts]
    _, no_val = build_datasets(DataConfig(synthetic="copy", synthetic_train_size=8, synthetic_val_size=0), tok)
    assert no_val is None
    with pytest.raises(ValueError, match="data.synthetic to one of arith, copy"):
        build_datasets(DataConfig(synthetic="sudoku"), tok)


def test_build_datasets_from_files(tmp_path, tok):
    write_parquet(verl_rows(6), str(tmp_path / "train.parquet"))
    write_jsonl(verl_rows(3), str(tmp_path / "val.jsonl"))
    cfg = DataConfig(train_files=[str(tmp_path / "train.parquet")], val_files=[str(tmp_path / "val.jsonl")])
    train, val = build_datasets(cfg, tok)
    assert (len(train), len(val)) == (6, 3)
    train, val = build_datasets(DataConfig(train_files=cfg.train_files), tok)
    assert val is None


# ----------------------------------------------------------------------------- sampler


def test_sampler_is_seeded_and_covers_each_epoch_without_repeats():
    assert PromptSampler(10, 5, seed=7).next_batch() == PromptSampler(10, 5, seed=7).next_batch()
    sampler = PromptSampler(10, 5, seed=7)
    epoch0 = sampler.next_batch() + sampler.next_batch()
    epoch1 = sampler.next_batch() + sampler.next_batch()
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1  # a fresh permutation each epoch
    assert sampler.epoch == 1
    assert PromptSampler(10, 5, seed=8).next_batch() != PromptSampler(10, 5, seed=7).next_batch()
    plain = PromptSampler(10, 5, shuffle=False)
    assert [plain.next_batch() for _ in range(3)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [0, 1, 2, 3, 4]]


def test_sampler_skips_an_epochs_remainder():
    sampler = PromptSampler(10, 4, shuffle=False)
    assert [sampler.next_batch() for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]
    assert sampler.batches_per_epoch == 2


def test_sampler_shards_the_global_batch_over_dp_ranks():
    global_batch = PromptSampler(20, 6, seed=1).next_global_batch()
    samplers = [PromptSampler(20, 6, seed=1, dp_rank=r, dp_size=3) for r in range(3)]
    for _ in range(7):
        shards = [s.next_batch() for s in samplers]
        assert all(len(s) == 2 for s in shards)
        assert len(set(sum(shards, []))) == 6
    first = [PromptSampler(20, 6, seed=1, dp_rank=r, dp_size=3).next_batch() for r in range(3)]
    assert sum(first, []) == global_batch


def test_sampler_resume_continues_exactly():
    ref = PromptSampler(13, 4, seed=5, dp_rank=1, dp_size=2)
    expected = [ref.next_batch() for _ in range(12)]
    first = PromptSampler(13, 4, seed=5, dp_rank=1, dp_size=2)
    got = [first.next_batch() for _ in range(5)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = PromptSampler(13, 4, seed=5, dp_rank=1, dp_size=2)
    resumed.load_state_dict(state)
    got += [resumed.next_batch() for _ in range(7)]
    assert got == expected


def test_sampler_errors():
    with pytest.raises(
        ValueError, match="data.train_batch_size=6 must be a positive multiple of the data-parallel size 4"
    ):
        PromptSampler(20, 6, dp_rank=0, dp_size=4)
    with pytest.raises(ValueError, match="3 prompts, fewer than data.train_batch_size=4"):
        PromptSampler(3, 4)
    state = PromptSampler(20, 4, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1.*resume with the same data"):
        PromptSampler(20, 4, seed=2).load_state_dict(state)


@pytest.mark.parametrize("num_items, batch_size, dp_size", [(10, 4, 1), (10, 4, 3), (7, 64, 2), (1, 2, 2)])
def test_val_batches_cover_every_prompt_once(num_items, batch_size, dp_size):
    per_rank = [val_batches(num_items, batch_size, r, dp_size) for r in range(dp_size)]
    assert len({len(b) for b in per_rank}) == 1  # same number of batches on every rank
    seen = sorted(i for batches in per_rank for batch in batches for i in batch)
    assert seen == list(range(num_items))


def test_val_accuracy_per_data_source():
    metrics = val_accuracy([1.0, 0.0, 1.0, 0.5, 1.0], ["arith", "arith", "copy", "copy", "copy"])
    assert metrics == {"val/accuracy": 0.6, "val/accuracy/arith": 0.5, "val/accuracy/copy": 2 / 3}


# ----------------------------------------------------------------------------- synthetic tasks


def test_arith_rows_are_seeded_correct_and_splits_disjoint():
    train = synthetic.make_arith_rows(400, seed=0, split="train", max_operand=20)
    assert train == synthetic.make_arith_rows(400, seed=0, split="train", max_operand=20)
    assert train != synthetic.make_arith_rows(400, seed=1, split="train", max_operand=20)
    val = synthetic.make_arith_rows(100, seed=0, split="val", max_operand=20)
    train_questions = {r["extra_info"]["question"] for r in train}
    assert not train_questions & {r["extra_info"]["question"] for r in val}
    for row in train + val:
        assert row["data_source"] == "arith"
        content = row["prompt"][0]["content"]
        assert "####" in content and row["extra_info"]["question"] in content
        a, op, b = row["extra_info"]["expression"].split()
        answer = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert row["reward_model"]["ground_truth"] == str(answer) and answer >= 0
        assert max(int(a), int(b)) <= 20


def test_copy_rows():
    rows = synthetic.make_copy_rows(50, seed=0, split="train")
    assert {r["prompt"][0]["content"] for r in rows} == {f"Copy: {d}" for d in range(10)}
    for r in rows:
        assert r["prompt"][0]["content"] == "Copy: " + r["reward_model"]["ground_truth"]
        assert r["data_source"] == "copy"
    assert rows != synthetic.make_copy_rows(50, seed=0, split="val")  # its own seed stream


def test_make_arith_cli_writes_verl_parquet(tmp_path):
    out = tmp_path / "arith"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "rlstack.data.make_arith",
            "--out",
            str(out),
            "--train",
            "12",
            "--val",
            "4",
            "--seed",
            "3",
        ],
        check=True,
        cwd=REPO,
        capture_output=True,
    )
    train = load_rows([str(out / "train.parquet")])
    val = load_rows([str(out / "val.parquet")])
    assert train == synthetic.make_arith_rows(12, seed=3, split="train")
    assert val == synthetic.make_arith_rows(4, seed=3, split="val")


# ----------------------------------------------------------------------------- bad data


BAD_ROWS = {  # name: (change to row 2, expected message after "data file F row 2: ")
    "missing column": (lambda r: r.pop("reward_model"), "missing column 'reward_model': every row needs"),
    "null reward_model": (
        lambda r: r.update(reward_model=None),
        "'reward_model' must be a mapping with 'ground_truth'",
    ),
    "prompt is a string": (
        lambda r: r.update(prompt="What is 2 plus 3?"),
        "malformed prompt 'What is 2 plus 3\\?': 'prompt' must be a non-empty list of chat",
    ),
    "empty prompt": (lambda r: r.update(prompt=[]), "malformed prompt \\[\\]"),
    "content missing": (
        lambda r: r.update(prompt=[{"role": "user", "content": None}]),
        "malformed prompt, message 0 has content None: each message needs a string 'content'",
    ),
    "bad role": (
        lambda r: r.update(prompt=[{"role": "human", "content": "hi"}]),
        "malformed prompt, message 0 has role 'human': use one of",
    ),
    "empty ground truth": (
        lambda r: r["reward_model"].update(ground_truth=""),
        "'reward_model.ground_truth' is empty: give every row its reference answer",
    ),
    "blank ground truth": (
        lambda r: r["reward_model"].update(ground_truth="  "),
        "'reward_model.ground_truth' is empty",
    ),
}
# A parquet column has one type in every row: a row cannot lack a column or hold a string prompt.
PARQUET_BAD_ROWS = [k for k in BAD_ROWS if k not in ("missing column", "prompt is a string")]


@pytest.mark.parametrize("fmt, case", [("jsonl", k) for k in BAD_ROWS] + [("parquet", k) for k in PARQUET_BAD_ROWS])
def test_bad_rows_name_file_row_and_fix(tmp_path, fmt, case):
    change, message = BAD_ROWS[case]
    rows = verl_rows(4)
    change(rows[2])
    path = str(tmp_path / f"bad.{fmt}")
    (write_parquet if fmt == "parquet" else write_jsonl)(rows, path)
    with pytest.raises(ValueError, match=f"^data file {re.escape(path)} row 2: {message}"):
        load_rows([path])


def test_missing_column_in_a_parquet_file(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "data_source"} for r in verl_rows(3)]
    path = str(tmp_path / "nods.parquet")
    write_parquet(rows, path)
    with pytest.raises(ValueError, match=f"^data file {re.escape(path)} row 0: missing column 'data_source'"):
        load_rows([path])
    write_parquet(verl_rows(3), str(tmp_path / "good.parquet"))
    with pytest.raises(ValueError, match="row 0: missing column 'question'.*set data.prompt_key"):
        load_rows([str(tmp_path / "good.parquet")], prompt_key="question")


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.parquet", None, "does not exist: fix the path in data.train_files/val_files"),
        ("corrupt.parquet", "not parquet at all", "is not a readable parquet file"),
        ("data.csv", "a,b\n1,2\n", "has an unknown suffix: use .parquet, .jsonl or .json"),
        ("empty.jsonl", "\n", "has no rows"),
        ("broken.jsonl", '{}\n\n{"data_source": \n', "row 1 \\(line 3\\) is not valid JSON"),
    ],
)
def test_unreadable_files(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=f"^data file {re.escape(str(path))} {message}"):
        load_rows([str(path)])


def test_bad_data_reports_the_first_bad_file_among_several(tmp_path):
    good = str(tmp_path / "good.jsonl")
    write_jsonl(verl_rows(3), good)
    bad_rows = verl_rows(3)
    bad_rows[1]["reward_model"]["ground_truth"] = ""
    bad = str(tmp_path / "bad.jsonl")
    write_jsonl(bad_rows, bad)
    with pytest.raises(ValueError, match=f"data file {re.escape(bad)} row 1:"):
        load_rows([good, bad])
