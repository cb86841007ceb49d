"""Custom reward functions from a user's Python file, with verl's signature.

verl calls `compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)`
by keyword (`verl/workers/reward_manager/naive.py`), so the function must accept those four
names; it returns a float or a dict with a "score" key (other keys are ignored here).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable

PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
SIGNATURE = "compute_score(data_source, solution_str, ground_truth, extra_info=None)"


def load_custom_reward(path: str, name: str = "compute_score") -> Callable[..., Any]:
    """The function `name` defined in the Python file `path`, checked to accept verl's call."""
    if not os.path.isfile(path):
        raise ValueError(f"reward file {path} does not exist: fix data.reward_fn_file")
    module = _import_file(path)
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"reward file {path} has no function {name!r}: define {SIGNATURE} there "
                         "or set data.reward_fn_name")
    if not callable(fn):
        raise ValueError(f"reward file {path}: {name!r} is a {type(fn).__name__}, not a function: "
                         f"define {SIGNATURE}")
    _check_signature(fn, path, name)
    return fn


def _import_file(path: str):
    # A unique module name per file path, so two reward files named alike do not collide.
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:10]
    module_name = f"rlstack_custom_reward_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"reward file {path} cannot be imported as Python: give it a .py suffix")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise ValueError(f"reward file {path} failed to import ({type(e).__name__}: {e}): "
                         "fix the error in that file") from e
    return module


def _check_signature(fn: Callable, path: str, name: str) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: the first call will tell
    try:
        signature.bind(**{p: None for p in PARAMS})
    except TypeError:
        raise ValueError(f"reward function {name}{signature} in {path} cannot be called as verl calls it: "
                         f"use the signature {SIGNATURE}") from None


def as_score(value: Any, name: str) -> float:
    """A custom function's return value (float, int, bool or {"score": ...}) as a float."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward function {name} returned a dict without 'score' "
                             f"(keys: {sorted(value)}): return a float or a dict with a 'score' key")
        value = value["score"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"reward function {name} returned {value!r}: return a float or "
                         "a dict with a 'score' key") from None
