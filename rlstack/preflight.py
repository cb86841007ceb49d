"""Everything a run needs, checked before any process group, model or engine starts.

`python -m rlstack.train --validate-only` and every real run call the same `preflight`, so both
give the same one-line messages: every config value check that needs no loaded model (the config
tree's own, `rlstack.config.check_values`, again: a tree built or changed in code gets them too;
the parallel layout and the rollout settings against the ranks, `rlstack.parallel.check_layout`),
the model directory (config.json and tokenizer files), the data files (exist, parse, first rows
valid; a synthetic set holds a batch), the reward file and function, and the output directory
(writable, and not holding an earlier run unless resumed or overwritten). Reads only; torch-free.
tests/unit/test_preflight_values.py runs it over a table of bad values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from rlstack.errors import UserError

FIRST_ROWS = 64  # rows per data file validated up front (the run validates all when it loads them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


@dataclass
class Preflight:
    dims: object  # megatron_bridge.parallel.ParallelDims
    data_sources: list
    resume_from: str  # checkpoint directory the run resumes from ("" = none)


def preflight(cfg, world_size: int) -> Preflight:
    """Raise the first UserError a run of `cfg` on `world_size` ranks would hit; what was found otherwise."""
    from rlstack import host_memory
    from rlstack.config import check_values
    from rlstack.parallel import check_layout

    check_values(cfg)
    for key in ("model.path", "model.critic_path", "reward_model.path"):
        check_model_dir(_get(cfg, key), key)
    if cfg.reward_model.path:
        check_reward_model_dir(cfg.reward_model.path)
    dims = check_layout(cfg, world_size)
    host_memory.wanted_allocator(cfg.parallel.host_allocator)  # tcmalloc asked for and not installed
    sources = check_data(cfg)
    check_reward(cfg, sources)
    resume_from = check_output_dir(cfg)
    return Preflight(dims=dims, data_sources=sources, resume_from=resume_from or "")


def _get(cfg, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


# ----------------------------------------------------------------------------- model


def check_model_dir(path, key: str) -> None:
    """`path` is `default`, `tiny`, a hub id cached locally (HF_HOME / HF_HUB_CACHE snapshot layout),
    or a local HF directory with config.json, tokenizer and weights."""
    from megatron_bridge import hub_cache
    from megatron_bridge.errors import InputError
    from megatron_bridge.hf_config import ModelArgs, read_hf_config

    if path in (None, "", "default", "tiny"):
        return
    if not os.path.exists(path) and hub_cache.looks_like_hub_id(path):
        try:
            path = hub_cache.resolve_hub_id(path)  # never downloads
        except InputError as e:
            raise UserError(f"{key}: {e}") from None
    if not os.path.exists(path):
        raise UserError(f"{key}={path} does not exist: pass an HF checkpoint directory, `default` or `tiny`")
    if not os.path.isdir(path):
        raise UserError(f"{key}={path} is a file: pass the HF checkpoint directory that holds config.json")
    from megatron_bridge.mappings import is_seq_cls_config, seq_cls_body_config

    config, source = read_hf_config(path), os.path.join(path, "config.json")
    if is_seq_cls_config(config):  # a reward model (or a critic exported as one): its decoder body
        config = seq_cls_body_config(config, f"{key}={path}")
    ModelArgs.from_hf_config(config, source)  # architecture, required keys
    names = set(os.listdir(path))
    if not names.intersection(TOKENIZER_FILES):
        raise UserError(
            f"{key}={path} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...): save the "
            "tokenizer into it with tokenizer.save_pretrained(DIR)"
        )
    if not names.intersection(WEIGHT_FILES):
        raise UserError(
            f"{key}={path} has no {WEIGHT_FILES[0]} (or its index): save the model with "
            "save_pretrained(DIR, safe_serialization=True)"
        )


def check_reward_model_dir(path: str, key: str = "reward_model.path") -> None:
    """A 1-label Llama/Qwen2 `*ForSequenceClassification` directory, else one line naming the fix."""
    from megatron_bridge.hf_config import ModelArgs, read_hf_config
    from megatron_bridge.mappings import is_seq_cls_config, seq_cls_body_config

    config = read_hf_config(path)
    if not is_seq_cls_config(config):
        archs = config.get("architectures") or [config.get("model_type")]
        raise UserError(
            f"{key}={path} is a {', '.join(map(str, archs))}, not a reward model: pass a "
            "*ForSequenceClassification checkpoint with num_labels=1 (e.g. a critic exported with "
            "`python -m rlstack.export --critic --critic-format seq-cls`)"
        )
    body = seq_cls_body_config(config, f"{key}={path}")  # InputError naming the architecture / num_labels fix
    ModelArgs.from_hf_config(body, f"{key}={path}")


# ----------------------------------------------------------------------------- data and rewards


def check_data(cfg) -> list:
    """Each data file exists and its first rows parse; returns the data sources seen."""
    from rlstack.data.rows import read_file, validate_row
    from rlstack.data.synthetic import make_rows

    d = cfg.data
    sources = set()
    for key, paths in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        for path in paths:
            rows = read_file(path)
            for index, item in enumerate(rows[:FIRST_ROWS]):
                sources.add(validate_row(item, f"data file {path} row {index}", d.prompt_key)["data_source"])
    if not d.train_files and d.synthetic:
        # (files: the sampler counts the prompts kept after data.truncation, when the run loads them)
        if d.synthetic_train_size < 1:
            raise UserError("the synthetic training set is empty: set data.synthetic_train_size >= 1")
        if d.synthetic_train_size < d.train_batch_size:
            raise UserError(
                f"data.synthetic_train_size={d.synthetic_train_size} prompts are fewer than "
                f"data.train_batch_size={d.train_batch_size}: lower data.train_batch_size or raise data.synthetic_train_size"
            )
        sources.update(
            row["data_source"] for row in make_rows(d.synthetic, 1, d.seed, "train", d.synthetic_max_operand)
        )
    return sorted(sources)


def check_reward(cfg, data_sources: list) -> None:
    """The reward file imports and defines the function; every data source has a scorer."""
    from rlstack.rewards import RewardScorer

    scorer = RewardScorer.from_config(cfg.data)
    if not cfg.reward_model.path:  # with a reward model, a source without a rule gets the RM's score alone
        scorer.check_sources(data_sources)


# ----------------------------------------------------------------------------- output directory


def check_output_dir(cfg):
    """trainer.output_dir can be written and holds no earlier run this one would overwrite.

    Returns the checkpoint the run resumes from (None: a fresh start). A fresh start into a
    directory with an earlier run's checkpoints or metrics is refused unless trainer.overwrite.
    """
    from rlstack.checkpoint import checkpoint_root, list_checkpoints, resolve_resume
    from rlstack.observability.trackers import METRICS_FILE

    out = cfg.trainer.output_dir
    _check_writable(out, "trainer.output_dir")
    if cfg.checkpoint.dir:
        _check_writable(cfg.checkpoint.dir, "checkpoint.dir")
    resume = None if cfg.trainer.overwrite else resolve_resume(cfg)
    if resume is not None:
        _check_steps_left(cfg, resume)
        return resume
    earlier = [path for _, path in list_checkpoints(checkpoint_root(cfg))]
    metrics = os.path.join(out, METRICS_FILE)
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        earlier.append(metrics)
    if earlier and not cfg.trainer.overwrite:
        how = (
            "resume it with checkpoint.resume=auto"
            if cfg.checkpoint.resume == "never" and len(earlier) > 1
            else "choose another trainer.output_dir"
        )
        raise UserError(
            f"trainer.output_dir={out} holds an earlier run ({earlier[0]}"
            f"{f' and {len(earlier) - 1} more' if len(earlier) > 1 else ''}): {how}, or set "
            "trainer.overwrite=true to delete its checkpoints and metrics and start afresh"
        )
    return None


def _check_steps_left(cfg, resume: str) -> None:
    import json

    from rlstack.checkpoint import TRAINER_STATE

    with open(os.path.join(resume, TRAINER_STATE)) as f:
        step = int(json.load(f)["step"])
    if step >= cfg.trainer.total_steps:
        raise UserError(
            f"the run in {cfg.trainer.output_dir} already reached step {step} ({resume}), and "
            f"trainer.total_steps={cfg.trainer.total_steps}: raise trainer.total_steps to train on, "
            "or choose another trainer.output_dir"
        )


def _check_writable(path: str, key: str) -> None:
    """`path` is a directory we can write, or can be created under a writable directory."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise UserError(
            f"{key}={path}: {probe} is a file, so the directory cannot be created there: choose another {key}"
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"{key}={path}: {probe} is not writable: choose another {key} or fix its permissions")
