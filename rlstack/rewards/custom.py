"""Custom reward functions from a user's Python file, called as verl calls them.

Per sample (verl's naive reward manager): `compute_score(data_source=..., solution_str=...,
ground_truth=..., extra_info=..., **reward_kwargs)`. Batched (verl's batch reward manager,
`data.reward_fn_batched: true`): `compute_score(data_sources=[...], solution_strs=[...],
ground_truths=[...], extra_infos=[...], **reward_kwargs)` returning one result per sample.
A result is a number or a dict `{"score": number, other keys...}`; the other keys come back as
`ScoreResult.extras` (the trainer logs the numeric ones as metrics, see `extras_metrics`).
An `async def` function is awaited. A call that runs past `timeout_s` scores 0.0 and
training goes on, as verl's `compute_score_timeout` does.

A result that is not a finite number (NaN, inf, None, a string, a dict without "score") or a
function that raises stops the run with a `UserError` naming the function, the data source and the
sample's row; a raised exception is chained (`from e`) so its traceback is shown once.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import inspect
import logging
import math
import numbers
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from rlstack.errors import UserError

log = logging.getLogger("rlstack.rewards")

PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCHED_PARAMS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")
SIGNATURE = "compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)"
BATCHED_SIGNATURE = "compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs)"


@dataclass
class ScoreResult:
    """One sample's reward: the score used for training, and the function's other dict keys."""

    score: float
    extras: dict[str, Any] = field(default_factory=dict)
    timed_out: bool = False


class RewardTimeout(Exception):
    """A reward call ran past data.reward_timeout_s (raised inside the call by SIGALRM)."""


# ----------------------------------------------------------------------------- loading


def load_custom_reward(path: str, name: str = "compute_score", batched: bool = False) -> Callable[..., Any]:
    """The function `name` defined in the Python file `path`, checked to accept verl's call."""
    if not os.path.isfile(path):
        raise UserError(f"reward file {path} does not exist: fix data.reward_fn_file")
    module = _import_file(path)
    fn = getattr(module, name, None)
    wanted = BATCHED_SIGNATURE if batched else SIGNATURE
    if fn is None:
        raise UserError(
            f"reward file {path} has no function {name!r}: define {wanted} there or set data.reward_fn_name"
        )
    if not callable(fn):
        raise UserError(f"reward file {path}: {name!r} is a {type(fn).__name__}, not a function: define {wanted}")
    _check_signature(fn, path, name, batched)
    return fn


def _import_file(path: str):
    # A unique module name per file path, so two reward files named alike do not collide.
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:10]
    module_name = f"rlstack_custom_reward_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"reward file {path} cannot be imported as Python: give it a .py suffix")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    try:
        spec.loader.exec_module(module)
    except (SystemExit, KeyboardInterrupt) as e:  # exit() at import would end the job silently
        del sys.modules[module_name]
        raise UserError(
            f"reward file {path} raised {type(e).__name__} while it was imported: remove the exit from that file"
        ) from None
    except Exception as e:
        del sys.modules[module_name]
        raise UserError(
            f"reward file {path} failed to import ({type(e).__name__}: {e}): fix the error in that file"
        ) from e
    return module


def _check_signature(fn: Callable, path: str, name: str, batched: bool) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: the first call will tell
    params = BATCHED_PARAMS if batched else PARAMS
    try:
        signature.bind(**{p: None for p in params})
    except TypeError:
        other = "data.reward_fn_batched=false" if batched else "data.reward_fn_batched=true"
        raise UserError(
            f"reward function {name}{signature} in {path} cannot be called as verl calls it: "
            f"use the signature {BATCHED_SIGNATURE if batched else SIGNATURE} "
            f"(or set {other} if it is the other form)"
        ) from None


# ----------------------------------------------------------------------------- calling


def call_with_timeout(fn: Callable, timeout_s: float, kwargs: dict) -> Any:
    """fn(**kwargs), awaited if it is a coroutine; RewardTimeout past timeout_s (0: no limit).

    SIGALRM interrupts pure-Python work (a regex that backtracks, a slow sympy call) in the
    main thread, as verl does. Off the main thread a signal cannot be used: the call runs in a
    daemon thread that is abandoned when late (it may finish in the background).
    """
    if timeout_s <= 0:
        return _resolve(fn(**kwargs))
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        return _call_with_alarm(fn, timeout_s, kwargs)
    return _call_in_thread(fn, timeout_s, kwargs)


def _resolve(value: Any) -> Any:
    return asyncio.run(value) if inspect.isawaitable(value) else value


def _call_with_alarm(fn: Callable, timeout_s: float, kwargs: dict) -> Any:
    def on_alarm(signum, frame):
        raise RewardTimeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return _resolve(fn(**kwargs))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _call_in_thread(fn: Callable, timeout_s: float, kwargs: dict) -> Any:
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = _resolve(fn(**kwargs))
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    worker = threading.Thread(target=target, daemon=True, name="rlstack-reward")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise RewardTimeout()
    if "error" in box:
        raise box["error"]
    return box["value"]


# ----------------------------------------------------------------------------- results


def as_result(value: Any, name: str, where: str) -> ScoreResult:
    """A reward function's return value as a ScoreResult; UserError when it is no finite number.

    `where` names the sample ("data_source 'x', row 3") for the message.
    """
    extras: dict[str, Any] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise UserError(
                f"reward function {name} returned a dict without 'score' (keys: "
                f"{sorted(map(str, value))}) for {where}: return a number or a dict "
                "with a 'score' key"
            )
        extras = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    number = _as_number(value)
    if number is None or not math.isfinite(number):
        raise UserError(
            f"reward function {name} returned score {value!r} for {where}: return a "
            "finite number (or a dict with a finite 'score')"
        )
    return ScoreResult(number, extras)


def _as_number(value: Any) -> Optional[float]:
    if getattr(value, "shape", None) == () and hasattr(value, "item"):
        value = value.item()  # numpy scalars, 0-d numpy arrays and tensors
    if isinstance(value, numbers.Real):  # bool, int, float (a str is not a score)
        return float(value)
    return None


def where(data_source: str, row: Any) -> str:
    return f"data_source {data_source!r}, row {row if row is not None else '?'}"


def extras_metrics(results: list[ScoreResult], prefix: str = "reward_extra/") -> dict[str, float]:
    """Mean of each numeric extra key over the samples that have it, plus the timed-out share.

    Non-numeric extras (strings, lists) are not metrics; they stay in ScoreResult.extras. For a
    data-parallel run, all-reduce the sums and counts (`extras_sums`) instead of averaging means.
    """
    return {k: total / count for k, (total, count) in extras_sums(results, prefix).items()}


def merge_extras_sums(parts: list[dict[str, tuple[float, int]]]) -> dict[str, float]:
    """Means from several ranks' extras_sums (e.g. all-gathered): sum the sums and counts, divide."""
    merged: dict[str, tuple[float, int]] = {}
    for part in parts:
        for key, (total, count) in part.items():
            t, c = merged.get(key, (0.0, 0))
            merged[key] = (t + total, c + count)
    return {k: total / count for k, (total, count) in sorted(merged.items()) if count}


def extras_sums(results: list[ScoreResult], prefix: str = "reward_extra/") -> dict[str, tuple[float, int]]:
    """{metric name: (sum, count)} over this rank's results; sum over ranks, then divide."""
    sums: dict[str, tuple[float, int]] = {}
    for result in results:
        for key, value in result.extras.items():
            number = _as_number(value)
            if number is None or not math.isfinite(number):
                continue
            total, count = sums.get(prefix + str(key), (0.0, 0))
            sums[prefix + str(key)] = (total + number, count + 1)
    if results:
        sums[prefix + "timed_out"] = (float(sum(r.timed_out for r in results)), len(results))
    return sums
