"""The one reader of HF `config.json` files (torch-free): parse, check, say what to fix.

Every caller that needs a model's shape (the bridge's builders, the trainer's layout checks, the
memory planner) reads it here, so a corrupt or incomplete file is one line naming the file and
the missing key, never a `KeyError` traceback deep in a builder.
"""

from __future__ import annotations

import json
import os

from megatron_bridge.errors import InputError

CONFIG_NAME = "config.json"
# Keys every supported decoder needs; the rest have defaults (see rlstack.models.ModelArgs).
REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def read_hf_config(hf_dir: str) -> dict:
    """The parsed, checked config.json of `hf_dir`; InputError naming the file and the fix otherwise."""
    path = os.path.join(hf_dir, CONFIG_NAME)
    if not os.path.isfile(path):
        raise InputError(f"{hf_dir} has no {CONFIG_NAME}: pass an HF checkpoint directory saved with save_pretrained")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"model config {path} is not valid JSON ({e}): re-save the model or restore the file") from None
    if not isinstance(config, dict):
        raise InputError(f"model config {path} must hold a JSON object: re-save the model")
    check_hf_config(config, path)
    return config


def check_hf_config(config: dict, source: str) -> None:
    missing = [k for k in REQUIRED_KEYS if config.get(k) is None]
    if missing:
        raise InputError(f"model config {source} lacks {', '.join(repr(k) for k in missing)}: it is incomplete; "
                         "re-save the model with save_pretrained")
    for key in REQUIRED_KEYS + ("num_key_value_heads",):
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InputError(f"model config {source} has {key}={value!r}: it must be a positive integer")
