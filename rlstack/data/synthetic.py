"""Synthetic tasks that ship with the code (no download), as verl-schema rows.

`SYNTHETIC_TASKS[name](n, seed, split, max_operand) -> rows`; `split` is "train" or "val".
- arith: one-step addition/subtraction word problems with GSM8K-style answers ("#### 12").
  Train and val are disjoint: a problem belongs to one split by a hash of its text, and each split
  draws from its own seed stream, so any train size and any val size never share a question.
- copy: "Copy: 7" -> "7", a task a tiny random-weight model learns in minutes with RL. There are
  only ten distinct prompts, so its val split (own seed stream) cannot be disjoint from train.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

from rlstack.errors import UserError

SPLITS = ("train", "val")
VAL_BUCKETS = 5  # one problem text in five belongs to the val split
# Said to the model in every arith prompt: "####" is what gsm8k strict scoring reads, and a short
# reasoning keeps SmolLM2 inside a 64-token response (measured here: most long answers hit the limit).
ARITH_INSTRUCTION = 'Solve it in one short sentence, then write the final answer as a number after "####".'

NAMES = (
    ("Tom", "He"),
    ("Anna", "She"),
    ("Ben", "He"),
    ("Mia", "She"),
    ("Sam", "He"),
    ("Lily", "She"),
    ("Jack", "He"),
    ("Emma", "She"),
)
ITEMS = (
    ("apple", "apples"),
    ("pencil", "pencils"),
    ("marble", "marbles"),
    ("cookie", "cookies"),
    ("sticker", "stickers"),
    ("book", "books"),
    ("orange", "oranges"),
    ("stamp", "stamps"),
)
ADD_TEMPLATES = (
    "{name} has {a_items}. {He} buys {b} more. How many {items} does {he} have now?",
    "{name} picked {a_items} in the morning and {b_items} in the afternoon. How many {items} did {he} pick in total?",
    "There are {a_items} in a box. {name} puts in {b} more. How many {items} are in the box now?",
)
SUB_TEMPLATES = (
    "{name} has {a_items}. {He} gives {b} to a friend. How many {items} does {he} have left?",
    "{name} had {a_items} and lost {b_items}. How many {items} does {he} have left?",
    "There are {a_items} on a table. {name} takes away {b}. How many {items} are on the table now?",
)


def _rng(task: str, seed: int, split: str) -> random.Random:
    if split not in SPLITS:
        raise UserError(f"synthetic split {split!r} is unknown: use one of {', '.join(SPLITS)}")
    return random.Random(f"{task}:{split}:{seed}")  # string seeds hash with sha512: stable everywhere


def _split_of(text: str) -> str:
    bucket = hashlib.sha1(text.encode()).digest()[0] % VAL_BUCKETS
    return "val" if bucket == 0 else "train"


def _count(n: int, item: tuple[str, str]) -> str:
    return f"{n} {item[0] if n == 1 else item[1]}"


def _arith_problem(rng: random.Random, max_operand: int) -> tuple[str, str, int]:
    """(question, expression, answer) for one random problem."""
    name, he = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    if rng.random() < 0.5:
        a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        template, expression, answer = rng.choice(ADD_TEMPLATES), f"{a} + {b}", a + b
    else:
        a = rng.randint(1, max_operand)
        b = rng.randint(1, a)
        template, expression, answer = rng.choice(SUB_TEMPLATES), f"{a} - {b}", a - b
    question = template.format(
        name=name, He=he, he=he.lower(), items=item[1], b=b, a_items=_count(a, item), b_items=_count(b, item)
    )
    return question, expression, answer


def make_arith_rows(n: int, seed: int = 0, split: str = "train", max_operand: int = 20) -> list[dict]:
    """`n` arithmetic word problems of `split`, data_source "arith", ground truth the integer."""
    if max_operand < 1:
        raise UserError(f"synthetic max_operand is {max_operand}: set data.synthetic_max_operand >= 1")
    rng = _rng("arith", seed, split)
    rows = []
    while len(rows) < n:
        question, expression, answer = _arith_problem(rng, max_operand)
        if _split_of(question) != split:
            continue  # the other split's problem: skipping it keeps the splits disjoint
        rows.append(
            {
                "data_source": "arith",
                "prompt": [{"role": "user", "content": f"{question}\n{ARITH_INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": len(rows), "question": question, "expression": expression},
            }
        )
    return rows


def make_copy_rows(n: int, seed: int = 0, split: str = "train", max_operand: int = 9) -> list[dict]:
    """`n` prompts "Copy: d" (one digit 0-9; `max_operand` is not used), ground truth "d"."""
    rng = _rng("copy", seed, split)
    rows = []
    for index in range(n):
        digit = str(rng.randint(0, 9))
        rows.append(
            {
                "data_source": "copy",
                "prompt": [{"role": "user", "content": f"Copy: {digit}"}],
                "ability": "copy",
                "reward_model": {"style": "rule", "ground_truth": digit},
                "extra_info": {"split": split, "index": index},
            }
        )
    return rows


SYNTHETIC_TASKS: dict[str, Callable[..., list[dict]]] = {
    "arith": make_arith_rows,
    "copy": make_copy_rows,
}


def make_rows(task: str, n: int, seed: int, split: str, max_operand: int) -> list[dict]:
    """Rows of the synthetic task `task`; an unknown name raises naming the choices."""
    if task not in SYNTHETIC_TASKS:
        raise UserError(
            f"synthetic task {task!r} is unknown: set data.synthetic to one of {', '.join(SYNTHETIC_TASKS)}"
        )
    if n < 0:
        raise UserError(f"synthetic size {n} is negative: set data.synthetic_train_size/val_size >= 0")
    return SYNTHETIC_TASKS[task](n, seed, split, max_operand)
