"""Everything a run needs, checked before any process group, model or engine starts.

`python -m rlstack.train --validate-only` and every real run call the same `preflight`, so both
give the same one-line messages: every config value check that needs no loaded model (the config
tree's own, `rlstack.config.check_values`, again: a tree built or changed in code gets them too;
the parallel layout and the rollout settings against the ranks, `rlstack.parallel.check_layout`),
the model directory (config.json and tokenizer files), the data files (exist, parse, first rows
valid; a synthetic set holds a batch), the reward file and function, and the output directory
(writable, and not holding an earlier run unless resumed or overwritten). Reads only; torch-free.
tests/unit/test_preflight_values.py runs it over a table of bad values. Checking a config for another machine (`--validate-only --model-config`),
a model directory or data file that is not here is a warning, not an error: the model's shape comes
from the given config.json.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from rlstack.agent.setup import check_agent_config
from rlstack.errors import UserError

FIRST_ROWS = 64  # rows per data file validated up front (the run validates all when it loads them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


@dataclass
class Preflight:
    dims: object  # megatron_bridge.parallel.ParallelDims
    data_sources: list
    resume_from: str  # checkpoint directory the run resumes from ("" = none)


def preflight(cfg, world_size: int, model_config_file=None) -> Preflight:
    """Raise the first UserError a run of `cfg` on `world_size` ranks would hit; what was found otherwise.

    With `model_config_file` (--model-config: the config is checked for another machine) a model
    directory or data file missing here is a warning."""
    from rlstack import host_memory
    from rlstack.config import check_values
    from rlstack.parallel import check_layout

    check_values(cfg)
    elsewhere = bool(model_config_file)
    for key in ("model.path", "model.critic_path", "reward_model.path"):
        if elsewhere and _absent_here(_get(cfg, key), key):
            continue
        check_model_dir(_get(cfg, key), key)
    if cfg.reward_model.path and os.path.isdir(cfg.reward_model.path):
        check_reward_model_dir(cfg.reward_model.path)
    dims = check_layout(cfg, world_size, model_config_file)
    check_lora(cfg)
    host_memory.wanted_allocator(cfg.parallel.host_allocator)  # tcmalloc asked for and not installed
    check_cache_dir(cfg)
    sources = check_data(cfg, missing_ok=elsewhere)
    check_reward(cfg, sources)
    check_algorithm_params(cfg)
    check_context_length(cfg, model_config_file)
    check_prompt_lengths(cfg)
    check_agent_config(cfg)  # rollout.agent_loop and rollout.multi_turn's tool files load
    resume_from = check_output_dir(cfg)
    if resume_from:
        check_checkpoint_model(cfg, resume_from)
    return Preflight(dims=dims, data_sources=sources, resume_from=resume_from or "")


def _get(cfg, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


# ----------------------------------------------------------------------------- LoRA


def lora_layer_dims(args) -> dict[str, tuple[int, int]]:
    """(in, out) of each LoRA target module (megatron names) of a dense model, whole (TP1)."""
    q_rows, kv_rows = args.num_attention_heads * args.head_dim, args.num_query_groups * args.head_dim
    return {
        "linear_qkv": (args.hidden_size, q_rows + 2 * kv_rows),
        "linear_proj": (q_rows, args.hidden_size),
        "linear_fc1": (args.hidden_size, 2 * args.ffn_hidden_size),  # SwiGLU: [gate; up]
        "linear_fc2": (args.ffn_hidden_size, args.hidden_size),
    }


def check_lora(cfg) -> None:
    """model.lora / critic.lora against the model and the other settings: one line naming the fix."""
    from rlstack.parallel import model_args_from_config

    sections = [("model.lora", cfg.model.lora), ("critic.lora", cfg.critic.lora)]
    if cfg.critic.lora.rank > 0 and cfg.algorithm.name != "ppo":
        raise UserError(
            f"critic.lora.rank={cfg.critic.lora.rank} but algorithm.name={cfg.algorithm.name} has no critic: "
            "set critic.lora.rank=0 (or algorithm.name=ppo)"
        )
    if not any(lora.rank > 0 for _, lora in sections):
        return
    if cfg.model.lora.rank > 0 and cfg.offload.reference:
        raise UserError(
            "offload.reference=true with model.lora: the reference is the actor with its adapters off, "
            "there is no reference model to offload: set offload.reference=false"
        )
    _check_lora_rollout(cfg)
    args = model_args_from_config(cfg.model)
    if args is None:
        return  # provisioned later (default, tiny): the shape is checked when the model is built
    for key, lora in sections:
        if lora.rank > 0:
            _check_lora_shape(key, lora, args, cfg.parallel.ep)


def _check_lora_rollout(cfg) -> None:
    """The rollout paths the LoRA weight sync (rlstack/rollout/lora_sync.py) reaches so far."""
    if cfg.model.lora.rank <= 0:
        return
    if cfg.placement.rollout_ranks > 0:
        raise UserError(
            f"model.lora.rank={cfg.model.lora.rank} with placement.rollout_ranks={cfg.placement.rollout_ranks}: "
            "the split sync does not send adapters yet; set placement.rollout_ranks=0 (colocated) or model.lora.rank=0"
        )
    from rlstack.rollout.lora_sync import lora_sync_mode
    from rlstack.rollout.vllm_engine import vllm_max_lora_rank

    if cfg.rollout.engine == "vllm" and lora_sync_mode(cfg.rollout) == "adapters":
        try:  # vLLM's LoRA path takes ranks up to 512
            vllm_max_lora_rank(cfg.model.lora.rank)
        except ValueError as e:
            raise UserError(str(e)) from None


def _check_lora_shape(key: str, lora, args, ep: int) -> None:
    from rlstack.config import LORA_TARGETS

    if args.moe is not None or ep > 1:
        raise UserError(
            f"{key}.rank={lora.rank} with a MoE model: LoRA on routed experts (split over EP) is not "
            f"supported yet: set {key}.rank=0 or use a dense model"
        )
    targets = LORA_TARGETS if "all-linear" in lora.target_modules else lora.target_modules
    for name, (fan_in, fan_out) in lora_layer_dims(args).items():
        if name in targets and lora.rank > min(fan_in, fan_out):
            raise UserError(
                f"{key}.rank={lora.rank} is larger than {name}'s dimensions ({fan_out} x {fan_in}): "
                f"set {key}.rank <= {min(fan_in, fan_out)}"
            )


def _absent_here(path, key: str) -> bool:
    """A model directory that is not on this machine, warned about (the config is checked for another)."""
    from megatron_bridge import hub_cache

    if path in (None, "", "default", "tiny") or os.path.exists(path):
        return False
    if hub_cache.looks_like_hub_id(path):
        try:
            hub_cache.resolve_hub_id(path)
            return False
        except Exception:
            pass
    _warn(f"{key}={path} is not on this machine: checked with --model-config; the run needs it there")
    return True


def _warn(message: str) -> None:
    import logging

    logging.getLogger("rlstack").warning(message)


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
        raise UserError(
            f"{key}={path} does not exist: pass an HF checkpoint directory, `default` or `tiny` (checking a "
            "config for another machine: --validate-only --model-config FILE|NAME)"
        )
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


def check_data(cfg, missing_ok: bool = False) -> list:
    """Each data file exists and its first rows parse; returns the data sources seen. With
    `missing_ok` (checking a config for another machine) a file not here is a warning."""
    from rlstack.data.rows import read_file, validate_row
    from rlstack.data.synthetic import make_rows

    d = cfg.data
    sources = set()
    for key, paths in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        _check_duplicate_files(paths, key)
        for path in paths:
            if missing_ok and not os.path.exists(path):
                _warn(f"{key}: {path} is not on this machine: its rows are not checked; the run needs it there")
                continue
            rows = read_file(path)
            if not rows:
                raise UserError(f"data file {path} has no rows: point {key} at a non-empty file")
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


def _check_duplicate_files(paths: list, key: str) -> None:
    import logging

    seen = set()
    for path in paths:
        real = os.path.realpath(path)
        if real in seen:
            logging.getLogger("rlstack").warning(
                "%s lists %s more than once: its rows are sampled that many times as often "
                "(remove the repeat unless that is what you want)",
                key,
                path,
            )
        seen.add(real)


def check_reward(cfg, data_sources: list) -> None:
    """The reward file imports and defines the function; every data source has a scorer."""
    from rlstack.rewards import RewardScorer

    scorer = RewardScorer.from_config(cfg.data)
    if not cfg.reward_model.path:  # with a reward model, a source without a rule gets the RM's score alone
        scorer.check_sources(data_sources)


# ----------------------------------------------------------------------------- algorithm parameters

# Estimators whose inputs rlstack's trainer does not produce yet: what each one lacks. None today
# (optimal_token_baseline's sum_pi_squared comes from the old-log-prob forward, ScoreForwards.fill).
_NEEDS_TRAINER: dict[str, str] = {}
# (parameter, test, what it must be) of each policy loss's own parameters (algorithm.policy_loss_params).
_LOSS_PARAM_RANGES = {
    "tau_pos": (lambda v: v > 0, "> 0"),
    "tau_neg": (lambda v: v > 0, "> 0"),
    "clip_cov_ratio": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "clip_cov_lb": (lambda v: True, "a number"),
    "clip_cov_ub": (lambda v: True, "a number"),
    "kl_cov_ratio": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "ppo_kl_coef": (lambda v: v >= 0, ">= 0"),
    "dro_beta": (lambda v: v is not None and v > 0, "> 0 (dro has no default: set it)"),
}


def check_algorithm_params(cfg) -> None:
    """The chosen policy loss's parameters, the estimator's inputs, overlong shaping and dynamic sampling."""
    import dataclasses
    import logging

    from rlstack.algorithms import names
    from rlstack.config import PolicyLossParams, adv_estimator

    a, log = cfg.algorithm, logging.getLogger("rlstack.preflight")
    own = names.POLICY_LOSS_PARAMS.get(a.policy_loss, ())
    for key in own:
        ok, what = _LOSS_PARAM_RANGES[key]
        value = getattr(a.policy_loss_params, key)
        if not ok(value):
            raise UserError(
                f"algorithm.policy_loss_params.{key} is {value} with policy_loss={a.policy_loss}: it must be {what}"
            )
    p = a.policy_loss_params
    if a.policy_loss == "clip_cov" and not p.clip_cov_lb < p.clip_cov_ub:
        raise UserError(
            f"algorithm.policy_loss_params.clip_cov_lb={p.clip_cov_lb} must be below clip_cov_ub={p.clip_cov_ub}"
        )
    for f in dataclasses.fields(PolicyLossParams):
        if f.name not in own and getattr(p, f.name) != getattr(PolicyLossParams(), f.name):
            log.warning("algorithm.policy_loss_params.%s has no effect with policy_loss=%s", f.name, a.policy_loss)
    if a.policy_loss in names.SEQUENCE_MEAN_LOSSES and a.loss_agg_mode != "seq-mean-token-mean":
        log.warning(
            "policy_loss=%s aggregates seq-mean-token-mean (as verl): algorithm.loss_agg_mode=%s has no effect on it",
            a.policy_loss,
            a.loss_agg_mode,
        )
    _check_estimator_inputs(cfg, adv_estimator(cfg))
    _check_dapo(cfg, log)


def _check_estimator_inputs(cfg, estimator: str) -> None:
    a = cfg.algorithm
    if estimator in _NEEDS_TRAINER:
        raise UserError(
            f"algorithm.adv_estimator={estimator} needs {_NEEDS_TRAINER[estimator]}, which rlstack's trainer "
            "does not provide yet: choose grpo, rloo, opo or another estimator"
        )
    extra_keys = [k for k in a.gdpo_reward_keys if k != "score"]
    if extra_keys and estimator == "gdpo" and not cfg.data.reward_fn_file:
        raise UserError(
            f"algorithm.gdpo_reward_keys={list(a.gdpo_reward_keys)} names keys of a custom reward function's "
            "returned dict, and the built-in rules return only 'score': set data.reward_fn_file to a function "
            f"returning {{'score': ..., {', '.join(repr(k) + ': ...' for k in extra_keys)}}}"
        )
    if a.gdpo_reward_weights and len(a.gdpo_reward_weights) != len(a.gdpo_reward_keys):
        raise UserError(
            f"algorithm.gdpo_reward_weights has {len(a.gdpo_reward_weights)} weights for "
            f"{len(a.gdpo_reward_keys)} gdpo_reward_keys: give one weight per key, or []"
        )


def _check_dapo(cfg, log) -> None:
    """reward.overlong_buffer and algorithm.filter_groups: values a run could use."""
    o, f = cfg.reward.overlong_buffer, cfg.algorithm.filter_groups
    if o.enable:
        if not 1 <= o.len <= cfg.rollout.max_new_tokens:
            raise UserError(
                f"reward.overlong_buffer.len is {o.len}: it must lie in [1, rollout.max_new_tokens="
                f"{cfg.rollout.max_new_tokens}] when reward.overlong_buffer.enable=true"
            )
        if o.penalty_factor < 0:
            raise UserError(f"reward.overlong_buffer.penalty_factor is {o.penalty_factor}: it must be >= 0")
    if f.max_num_gen_batches < 0:
        raise UserError(
            f"algorithm.filter_groups.max_num_gen_batches is {f.max_num_gen_batches}: use >= 0 (0: no limit)"
        )
    if f.enable and cfg.placement.rollout_ranks > 0 and cfg.rollout.staleness > 0:
        raise UserError(
            f"algorithm.filter_groups.enable with placement.rollout_ranks > 0 and rollout.staleness="
            f"{cfg.rollout.staleness}: the next steps' prompts are already drawn and queued on the rollout ranks "
            "when a step's extra rounds would run; set rollout.staleness=0 (or colocated placement)"
        )


# ----------------------------------------------------------------------------- output directory


def check_output_dir(cfg):
    """trainer.output_dir can be written and holds no earlier run this one would overwrite.

    Returns the checkpoint the run resumes from (None: a fresh start). A fresh start into a
    directory with an earlier run's checkpoints or metrics is refused unless trainer.overwrite.
    """
    from rlstack import run_dir
    from rlstack.checkpoint import checkpoint_root, list_checkpoints, resolve_resume
    from rlstack.observability.trackers import METRICS_FILE

    out = cfg.trainer.output_dir
    _check_writable(out, "trainer.output_dir")
    # Rank 0 takes the lock before its preflight and is the one that refuses a live run; another
    # rank of the same job could read the lock while rank 0 is between taking it and writing its
    # name into it (a killed run's stale name still there) and refuse its own job.
    live = run_dir.holder(out) if int(os.environ.get("RANK", "0") or 0) == 0 else None
    if live is not None and not run_dir.is_this_job(live):
        raise run_dir.refuse_live(out, live)
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


def check_context_length(cfg, model_config_file=None) -> None:
    """A prompt plus its response must fit the model's positions (RoPE tables, engine's max_model_len)."""
    from rlstack.planner.shapes import hf_config_for

    try:
        hf, source = hf_config_for(cfg.model, model_config_file)
    except UserError:
        return  # check_model_dir named the problem, or the planner will
    limit = hf.get("max_position_embeddings")
    longest = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    if isinstance(limit, int) and longest > limit:
        raise UserError(
            f"data.max_prompt_length + rollout.max_new_tokens = {cfg.data.max_prompt_length} + "
            f"{cfg.rollout.max_new_tokens} = {longest} tokens, over the model's max_position_embeddings="
            f"{limit} ({source}): lower rollout.max_new_tokens or data.max_prompt_length"
        )


def check_prompt_lengths(cfg) -> None:
    """Every prompt fits data.max_prompt_length after the chat template (as the run checks when
    it builds the dataset), when the tokenizer is on disk already (a local model directory, or a
    tiny/default model built before); otherwise the run checks it before its first step."""
    directory = _tokenizer_dir(cfg.model)
    files = cfg.data.train_files + cfg.data.val_files
    if directory is None or not files or not all(os.path.exists(path) for path in files):
        return
    from transformers import AutoTokenizer

    from rlstack.data.dataset import PromptDataset
    from rlstack.data.rows import load_rows

    tokenizer = AutoTokenizer.from_pretrained(directory)
    d = cfg.data
    for paths in (d.train_files, d.val_files):
        if paths:
            PromptDataset(
                load_rows(paths, d.prompt_key),
                tokenizer,
                d.max_prompt_length,
                d.truncation,
                d.system_prompt,
                d.prompt_key,
            )


def _tokenizer_dir(model_cfg):
    from megatron_bridge import hub_cache
    from megatron_bridge.errors import InputError

    path = model_cfg.path
    if path == "default":
        from megatron_bridge.default_model import default_model_dir

        path = default_model_dir(model_cfg.cache_dir)
    elif path == "tiny":
        return None  # built on the fly with a vocabulary of its own: the run checks it
    elif not os.path.exists(path) and hub_cache.looks_like_hub_id(path):
        try:
            path = hub_cache.resolve_hub_id(path)
        except InputError:
            return None
    if os.path.isdir(path) and set(os.listdir(path)).intersection(TOKENIZER_FILES):
        return path
    return None


def check_checkpoint_model(cfg, resume: str) -> None:
    """The checkpoint a run resumes from was saved for this actor model (same architecture and shape)."""
    import json
    from dataclasses import asdict

    from megatron_bridge.hf_config import ModelArgs
    from rlstack.checkpoint import TRAINER_STATE
    from rlstack.planner.shapes import hf_config_for

    try:
        hf, source = hf_config_for(cfg.model)
        now = asdict(ModelArgs.from_hf_config(hf, source))
    except Exception:
        return  # the model directory's own check reports it
    with open(os.path.join(resume, TRAINER_STATE)) as f:
        saved = json.load(f).get("model_args", {}).get("actor")
    if not saved:
        return
    diff = {k: (saved.get(k), v) for k, v in now.items() if k in saved and saved.get(k) != v}
    if diff:
        shown = ", ".join(f"{k} {a} vs {b}" for k, (a, b) in list(diff.items())[:4])
        raise UserError(
            f"checkpoint {resume} was saved for a different actor model ({shown}; saved vs model.path="
            f"{cfg.model.path}): resume with the model it was trained from, or set checkpoint.resume=never "
            "with another trainer.output_dir"
        )


def check_cache_dir(cfg) -> None:
    """The cache of built models (RLSTACK_CACHE or model.cache_dir) can be written when one is used."""
    from megatron_bridge.tiny import default_cache_dir

    paths = (cfg.model.path, getattr(cfg.model, "critic_path", ""))
    if not any(p in ("default", "tiny") for p in paths):
        return
    if getattr(cfg.model, "cache_dir", ""):
        _check_writable(cfg.model.cache_dir, "model.cache_dir")
    else:
        key = "RLSTACK_CACHE (environment variable)" if os.environ.get("RLSTACK_CACHE") else "RLSTACK_CACHE"
        _check_writable(default_cache_dir(), key)


def _check_steps_left(cfg, resume: str) -> None:
    import json

    from rlstack.checkpoint import TRAINER_STATE

    with open(os.path.join(resume, TRAINER_STATE)) as f:
        step = int(json.load(f)["step"])
    if step >= cfg.trainer.total_steps:
        raise UserError(
            f"the run in {cfg.trainer.output_dir} is already complete: it already reached step {step} ({resume}), and "
            f"trainer.total_steps={cfg.trainer.total_steps}: raise trainer.total_steps to train on, "
            "or choose another trainer.output_dir"
        )


def _check_writable(path: str, key: str) -> None:
    """`path` is a directory we can write, or can be created under a writable directory.

    Probed by doing it (create the missing directories and a file, then remove all of it): root
    passes os.access everywhere, and /proc or a read-only mount only fail when written. Every rank
    probes at once: a directory another rank's probe made and removed under us is probed again."""
    for _ in range(4):
        try:
            return _probe_writable(path, key, retry=True)
        except FileNotFoundError:
            continue
    _probe_writable(path, key, retry=False)


def _probe_writable(path: str, key: str, retry: bool) -> None:
    import tempfile

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
    target = os.path.abspath(path)
    created = []
    try:
        for missing in _missing_dirs(target, probe):
            try:
                os.mkdir(missing)
            except FileExistsError:  # another rank's probe made it at the same moment: its to remove
                continue
            created.append(missing)
        fd, name = tempfile.mkstemp(prefix=".rlstack-probe-", dir=target)
        os.close(fd)
        os.remove(name)
    except OSError as e:
        if retry and isinstance(e, FileNotFoundError):  # raced, or /proc (ENOENT on mkdir): once more
            raise
        raise UserError(
            f"{key}={path} cannot be written ({e.strerror} at {e.filename or probe}): choose another {key} "
            "or fix its permissions"
        ) from None
    finally:
        for directory in reversed(created):
            try:
                os.rmdir(directory)
            except OSError:
                pass


def _missing_dirs(target: str, existing: str) -> list[str]:
    """The directories between `existing` (excluded) and `target` (included), outermost first."""
    missing = []
    while target != existing:
        missing.append(target)
        target = os.path.dirname(target)
    return list(reversed(missing))
