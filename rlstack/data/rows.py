"""Prompt rows in verl's schema, read from parquet or JSON-lines files and validated up front.

A row: {"data_source": str, "prompt": [{"role": .., "content": ..}, ...], "ability": str,
"reward_model": {"style": str, "ground_truth": str}, "extra_info": dict}. `ability` and
`extra_info` are optional (filled with "" and {}); the rest is required. Every row of every file
is checked before anything trains, and the first problem is one `ValueError` naming the file, the
0-based row index (as pyarrow and pandas count rows) and the fix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from rlstack.errors import UserError

REQUIRED_COLUMNS = ("data_source", "reward_model")  # plus the prompt column (prompt_key)
ROLES = ("system", "user", "assistant", "tool")
PARQUET_SUFFIXES = (".parquet", ".pq")
JSON_SUFFIXES = (".jsonl", ".json")


class Row(dict):
    """A row (a plain dict in every comparison) that remembers where it came from for errors."""

    origin: str = ""  # e.g. "data file /d/train.parquet row 12"


def row_origin(row: dict, index: int) -> str:
    """How an error names `row`: its file and row when it was loaded, else its position."""
    return getattr(row, "origin", "") or f"row {index} of the given rows"


def load_rows(paths: Iterable[str], prompt_key: str = "prompt") -> list[dict]:
    """All rows of `paths` in order, each validated; raises one ValueError for the first bad row."""
    if isinstance(paths, str):
        paths = [paths]
    rows: list[dict] = []
    for path in paths:
        raw = read_file(path)
        if not raw:
            raise UserError(f"data file {path} has no rows: point data.train_files/val_files at a non-empty file")
        for index, item in enumerate(raw):
            origin = f"data file {path} row {index}"
            row = Row(validate_row(item, origin, prompt_key))
            row.origin = origin
            rows.append(row)
    return rows


def read_file(path: str) -> list[Any]:
    if not os.path.isfile(path):
        raise UserError(f"data file {path} does not exist: fix the path in data.train_files/val_files")
    lower = path.lower()
    if lower.endswith(PARQUET_SUFFIXES):
        return _read_parquet(path)
    if lower.endswith(JSON_SUFFIXES):
        return _read_json(path)
    raise UserError(f"data file {path} has an unknown suffix: use .parquet, .jsonl or .json (JSON lines)")


def _read_parquet(path: str) -> list[Any]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError subclasses for unreadable files
        raise UserError(
            f"data file {path} is not a readable parquet file ({_first_line(e)}): "
            "rewrite it with rlstack.data.rows.write_parquet or pandas.to_parquet"
        ) from e
    return table.to_pylist()


def _read_json(path: str) -> list[Any]:
    """JSON lines; a `.json` file holding one JSON array is read as that array of rows."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(
            f"data file {path} cannot be read as UTF-8 text ({_first_line(e)}): check the file and its permissions"
        ) from e
    if path.lower().endswith(".json") and text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(
                f"data file {path} is not valid JSON ({e.msg} at line {e.lineno}): "
                "fix the file or write one JSON object per line"
            ) from e
    rows = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue  # blank lines are not rows, as in pandas.read_json(lines=True)
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise UserError(
                f"data file {path} row {len(rows)} (line {line_number}) is not valid JSON "
                f"({e.msg}): write one JSON object per line"
            ) from e
    return rows


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


# ----------------------------------------------------------------------------- validation


def validate_row(item: Any, origin: str, prompt_key: str = "prompt") -> dict:
    """`item` checked against verl's schema; optional fields filled. `origin` prefixes errors."""
    if not isinstance(item, dict):
        raise UserError(
            f"{origin}: a row must be a JSON object/record, got {type(item).__name__}: "
            "write one verl-schema object per row"
        )
    for column in (*REQUIRED_COLUMNS, prompt_key):
        if column not in item:
            raise UserError(
                f"{origin}: missing column '{column}': every row needs data_source, "
                f"{prompt_key}, reward_model (set data.prompt_key if the prompt column has another name)"
            )
    row = dict(item)
    _check_data_source(row["data_source"], origin)
    _check_messages(row[prompt_key], origin, prompt_key)
    _check_reward_model(row["reward_model"], origin)
    row.setdefault("ability", "")
    if row["ability"] is None:
        row["ability"] = ""
    if row.get("extra_info") is None:
        row["extra_info"] = {}  # parquet stores an all-empty extra_info column as nulls
    if not isinstance(row["extra_info"], dict):
        raise UserError(
            f"{origin}: 'extra_info' must be a mapping, got {type(row['extra_info']).__name__}: "
            "store extra fields as an object"
        )
    return row


def _check_data_source(value: Any, origin: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise UserError(
            f"{origin}: 'data_source' must be a non-empty string, got {value!r}: "
            "name the dataset (it selects the reward scorer), e.g. 'openai/gsm8k'"
        )


def _check_messages(messages: Any, origin: str, prompt_key: str) -> None:
    fix = f"'{prompt_key}' must be a non-empty list of chat messages like [{{'role': 'user', 'content': '...'}}]"
    if not isinstance(messages, (list, tuple)) or len(messages) == 0:
        raise UserError(f"{origin}: malformed prompt {_short(messages)}: {fix}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise UserError(f"{origin}: malformed prompt, message {i} is {_short(message)}: {fix}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise UserError(f"{origin}: malformed prompt, message {i} has role {role!r}: use one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise UserError(
                f"{origin}: malformed prompt, message {i} has content {_short(content)}: "
                "each message needs a string 'content'"
            )


def _check_reward_model(value: Any, origin: str) -> None:
    if not isinstance(value, dict) or "ground_truth" not in value:
        raise UserError(
            f"{origin}: 'reward_model' must be a mapping with 'ground_truth' (and 'style'), "
            f"got {_short(value)}: add reward_model={{'style': 'rule', 'ground_truth': ...}}"
        )
    truth = value["ground_truth"]
    if isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
        raise UserError(
            f"{origin}: 'reward_model.ground_truth' must be a string or number, got "
            f"{_short(truth)}: store the reference answer as text"
        )
    if str(truth).strip() == "":
        raise UserError(
            f"{origin}: 'reward_model.ground_truth' is empty: give every row its reference answer, or remove the row"
        )


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------- writing


def write_parquet(rows: list[dict], path: str) -> None:
    """Rows -> one parquet file with verl's nested columns (prompt: list<struct>, structs)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Parquet cannot store a struct with no fields, so an empty extra_info is written as null
    # (load_rows reads null back as {}).
    plain = [{k: (None if k == "extra_info" and v == {} else v) for k, v in row.items()} for row in rows]
    try:
        table = pa.Table.from_pylist(plain)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise UserError(
            f"cannot write rows to {path} as parquet ({_first_line(e)}): give each column "
            "one type in every row, or use write_jsonl"
        ) from e
    _make_parent(path)
    pq.write_table(table, path)


def write_jsonl(rows: list[dict], path: str) -> None:
    """Rows -> JSON lines (UTF-8, one object per line)."""
    _make_parent(path)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(dict(row), ensure_ascii=False) + "\n")


def _make_parent(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
