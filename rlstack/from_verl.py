"""Translate a verl `main_ppo` command line into an rlstack experiment YAML.

    python -m rlstack.from_verl [--out FILE] [--strict] key=value ...
    python -m rlstack.from_verl --out ppo.yaml -- python3 -m verl.trainer.main_ppo data.train_files=... ...

Every translated key gets a comment naming the verl setting it came from; keys rlstack does not
need (FSDP settings, padding removal, ...) are listed as ignored, keys whose behaviour rlstack
cannot reproduce are listed as UNSUPPORTED at the end of the file and on stderr (`--strict` then
exits 1). Units differ in two places, converted here:
- verl's `ppo_mini_batch_size` counts prompts; rlstack's `algorithm.mini_batch_size` counts
  sequences: x rollout.n (and 0, "the whole batch", when it equals the train batch);
- verl's `*_micro_batch_size_per_gpu` is per GPU, as rlstack's `algorithm.micro_batch_size` (per
  data-parallel rank; one size for actor, critic, reference and log-prob passes); the deprecated
  global `ppo_micro_batch_size` is divided by the number of GPUs.
verl defaults that differ from rlstack's (use_kl_loss false, weight_decay 0.01, cliprange_value
0.5, 512-token prompts and responses, ...) are written out, so the run means what it meant in verl.
`critic.model.path`, or verl's default estimator `gae`, means PPO with a critic.
Written against verl 0.9.1's `verl/trainer/config/_generated_ppo_trainer.yaml`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from rlstack.verl_keys import (  # noqa: F401 (the tables and rlstack_name_for are this module's API too)
    ACTOR,
    AGENT_KEYS,
    AGENT_LOOPS,
    DIRECT,
    ENGINES,
    ESTIMATORS,
    ESTIMATORS_NOT_RUNNABLE,
    FILTER_METRICS,
    IGNORED_PREFIXES,
    MODEL,
    MULTI_TURN,
    OVERLONG_PREFIXES,
    REF,
    ROLLOUT,
    SCHEDULES,
    SHARED_TARGETS,
    SPECIAL,
    TRACKERS,
    VERL_DEFAULTS,
    _ignored_reason,
    rlstack_name_for,
)


@dataclass
class Translation:
    """rlstack values with the verl setting each came from, and what was left out."""

    values: dict[str, Any] = field(default_factory=dict)  # rlstack dotted key -> value
    sources: dict[str, str] = field(default_factory=dict)  # rlstack dotted key -> comment
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (verl key=value, why)
    unsupported: list[tuple[str, str]] = field(default_factory=list)  # (verl key=value, why)
    world_size: int = 1
    nnodes: int = 1

    def set(self, key: str, value: Any, source: str) -> None:
        self.values[key] = value
        self.sources[key] = source


# ----------------------------------------------------------------------------- parsing


def parse_command_line(tokens: list[str]) -> dict[str, Any]:
    """verl's `key=value` overrides (Hydra syntax, values read as YAML) -> {dotted key: value}.

    A pasted shell command works: tokens before `-m verl.trainer.main_ppo` (env assignments,
    python3), and everything from a pipe or a redirection on, are skipped; `+key` and `++key` are
    read as `key`.
    """
    if "verl.trainer.main_ppo" in tokens:
        tokens = tokens[tokens.index("verl.trainer.main_ppo") + 1 :]
    out: dict[str, Any] = {}
    for token in tokens:
        if token in ("|", "\\") or token.startswith((">", "2>", "1>", "&")):
            if token == "\\":
                continue
            break
        if "=" not in token:
            continue
        key, text = token.split("=", 1)
        key = key.lstrip("+")
        if "." not in key and key.isupper():
            continue  # an environment assignment such as PYTHONUNBUFFERED=1
        out[key] = _yaml_value(text)
    return out


# Plain values YAML 1.1 reads as numbers, booleans or dates where Hydra (verl's parser) reads text:
# a leading zero (010), base 60 (1:30), a date, yes/no/on/off.
_HYDRA_TEXT = re.compile(
    r"[-+]?0[0-9_]+|\d{4}-\d\d?-\d\d?([Tt ].*)?|[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?|(?i:yes|no|on|off|y|n)"
)


def _yaml_value(text: str) -> Any:
    if text == "":
        return ""
    if _HYDRA_TEXT.fullmatch(text):
        return text  # trainer.experiment_name=010 stays "010", as verl reads it
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and value.lower() in ("null", "none", "~"):
        return None
    if isinstance(value, str):
        try:
            return float(value)  # PyYAML reads 1e-6 (no dot) as a string
        except ValueError:
            pass
    return value


# ----------------------------------------------------------------------------- translating


def translate(verl: dict[str, Any]) -> Translation:
    """verl settings {dotted key: value} -> Translation (pure; reads train files to count rows)."""
    t = Translation()
    given = dict(verl)
    merged = {**VERL_DEFAULTS, **given}

    def src(key: str) -> str:
        return f"verl {key}={_flow(given[key])}" if key in given else f"verl's default {key}={_flow(merged[key])}"

    t.nnodes = int(merged.get("trainer.nnodes") or 1)
    t.world_size = int(merged.get("trainer.n_gpus_per_node") or 1) * t.nnodes
    handled = _direct(merged, given, t, src)
    handled |= _translate_special(merged, given, t, src)
    handled |= _layout_offload_and_cache(merged, given, t, src)
    _default_files(given, t)
    for key, value in given.items():
        if key in handled or key in SPECIAL:
            continue
        reason = _ignored_reason(key)
        if reason:
            t.ignored.append((f"{key}={_flow(value)}", reason))
        elif not is_verl_key(key):
            t.unsupported.append((f"{key}={_flow(value)}", not_verl_message(key)))
        else:
            t.unsupported.append((f"{key}={_flow(value)}", "no rlstack equivalent"))
    return t


def _direct(merged: dict, given: dict, t: Translation, src: Callable[[str], str]) -> set[str]:
    """Keys with the same meaning and unit; where two verl keys feed one rlstack key with different
    values (data.max_response_length and rollout.response_length, ...), the loser is named with the winner."""
    winner: dict[str, str] = {}
    for key, value in merged.items():
        if key not in DIRECT:
            continue
        target = DIRECT[key]
        earlier = winner.get(target)
        if earlier in given and key in given and given[earlier] != value:
            t.ignored.append(
                (f"{earlier}={_flow(given[earlier])}", f"{key}={_flow(value)} sets {target} too, and wins")
            )
        if earlier in given and key not in given:
            continue  # a verl default never overrides a key the user gave
        t.set(target, value, src(key))
        winner[target] = key
    return {key for key in merged if key in DIRECT}


def _translate_special(merged: dict, given: dict, t: Translation, src: Callable[[str], str]) -> set[str]:
    """Keys whose translation depends on other keys; returns the verl keys handled here."""
    handled: set[str] = set()
    parts = (
        _algorithm,
        _schedules,
        _batches_and_paths,
        _engine,
        _recompute,
        _lora,
        _data_keys,
        _rewards,
        _trainer_keys,
        _agent_keys,
        _async_keys,
    )
    for part in parts:
        handled |= part(merged, given, t, src)
    return handled


def _algorithm(merged: dict, given: dict, t: Translation, src: Callable[[str], str]) -> set[str]:
    """Estimator, PPO-or-GRPO, clip ratios and the keys actor and critic share."""
    handled: set[str] = set()
    estimator = merged["algorithm.adv_estimator"]
    if estimator == "grpo" and merged.get("algorithm.norm_adv_by_std_in_grpo") is False:
        t.set(
            "algorithm.adv_estimator",
            "drgrpo",
            src("algorithm.adv_estimator") + " with norm_adv_by_std_in_grpo=False (Dr.GRPO)",
        )
    elif estimator in ESTIMATORS:
        t.set("algorithm.adv_estimator", ESTIMATORS[estimator], src("algorithm.adv_estimator"))
    else:
        t.unsupported.append(
            (
                f"algorithm.adv_estimator={estimator}",
                f"estimator not in rlstack: use one of {', '.join(sorted(set(ESTIMATORS.values())))}",
            )
        )
    if estimator in ESTIMATORS_NOT_RUNNABLE:
        t.unsupported.append((f"algorithm.adv_estimator={estimator}", ESTIMATORS_NOT_RUNNABLE[estimator]))
    if estimator == "grpo_passk" and merged.get("algorithm.norm_adv_by_std_in_grpo") is False:
        t.unsupported.append(
            ("algorithm.norm_adv_by_std_in_grpo=False", "rlstack's grpo_passk always divides by the group std")
        )
    handled |= {"algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo"}
    handled |= _policy_loss(given, t, src)
    critic_path = given.get("critic.model.path")
    if critic_path is not None or estimator == "gae":
        why = src("critic.model.path") if critic_path is not None else src("algorithm.adv_estimator")
        t.set("algorithm.name", "ppo", why + " (PPO with a critic)")
        if critic_path is not None and critic_path != merged.get(MODEL + "path"):
            t.set("model.critic_path", critic_path, src("critic.model.path"))
    else:
        t.set("algorithm.name", "grpo", src("algorithm.adv_estimator") + " (critic-free)")
    if t.values["algorithm.name"] != "ppo":
        t.values.pop("algorithm.value_clip", None)  # verl's critic default means nothing without one
        t.sources.pop("algorithm.value_clip", None)
    handled.add("critic.model.path")
    if ACTOR + "clip_ratio" in given:
        for side in ("low", "high"):
            if ACTOR + f"clip_ratio_{side}" not in given:
                t.set(f"algorithm.clip_ratio_{side}", given[ACTOR + "clip_ratio"], src(ACTOR + "clip_ratio"))
        if all(ACTOR + f"clip_ratio_{side}" in given for side in ("low", "high")):
            t.ignored.append(
                (
                    f"{ACTOR}clip_ratio={_flow(given[ACTOR + 'clip_ratio'])}",
                    "clip_ratio_low and clip_ratio_high are both given, and win (as in verl)",
                )
            )
    handled.add(ACTOR + "clip_ratio")
    _shared(merged, given, t, src, ACTOR + "ppo_epochs", "critic.ppo_epochs", "algorithm.ppo_epochs")
    _shared(merged, given, t, src, ACTOR + "grad_clip", "critic.grad_clip", "algorithm.clip_grad")
    _shared(merged, given, t, src, ACTOR + "optim.weight_decay", "critic.optim.weight_decay", "algorithm.weight_decay")
    _shared(merged, given, t, src, ACTOR + "loss_agg_mode", "critic.loss_agg_mode", "algorithm.loss_agg_mode")
    handled |= {"critic.ppo_epochs", "critic.grad_clip", "critic.optim.weight_decay", "critic.loss_agg_mode"}
    return handled


def _policy_loss(given: dict, t: Translation, src: Callable[[str], str]) -> set[str]:
    """A loss mode rlstack lacks is named, not written (the config would refuse it); the old
    use_token_level_loss flag is a loss_agg_mode."""
    from rlstack.algorithms.names import POLICY_LOSSES

    mode = given.get(ACTOR + "policy_loss.loss_mode")
    if mode is not None and mode not in POLICY_LOSSES:
        t.values.pop("algorithm.policy_loss", None)
        t.sources.pop("algorithm.policy_loss", None)
        t.unsupported.append((f"{ACTOR}policy_loss.loss_mode={mode}", f"rlstack's losses: {', '.join(POLICY_LOSSES)}"))
    flag = given.get(ACTOR + "use_token_level_loss")
    if flag is not None and ACTOR + "loss_agg_mode" not in given:
        mode = "token-mean" if str(flag).lower() == "true" else "seq-mean-token-mean"
        t.set("algorithm.loss_agg_mode", mode, src(ACTOR + "use_token_level_loss"))
    return {ACTOR + "use_token_level_loss"}


def _schedules(merged: dict, given: dict, t: Translation, src: Callable[[str], str]) -> set[str]:
    """LR schedule style and warm-up."""
    handled: set[str] = set()
    for key in (ACTOR + "optim.lr_scheduler_type", ACTOR + "optim.warmup_style"):
        if given.get(key) is not None:
            value = given[key]
            if value in SCHEDULES:
                t.set("algorithm.lr_schedule", SCHEDULES[value], src(key))
            else:
                t.unsupported.append((f"{key}={value}", "rlstack schedules: constant | cosine"))
            handled.add(key)
    if "critic.optim.lr_warmup_steps_ratio" in given and ACTOR + "optim.lr_warmup_steps_ratio" not in given:
        t.set(
            "algorithm.lr_warmup_ratio",
            given["critic.optim.lr_warmup_steps_ratio"],
            src("critic.optim.lr_warmup_steps_ratio"),
        )
    handled.add("critic.optim.lr_warmup_steps_ratio")
    for key in (ACTOR + "optim.lr_warmup_steps", "critic.optim.lr_warmup_steps"):
        if key in t.sources and merged[key] is not None and int(merged[key]) < 0:
            target = DIRECT[key]
            t.set(target, 0, src(key) + " (-1: use the warm-up ratio)")
    return handled


def _batches_and_paths(merged: dict, given: dict, t: Translation, src: Callable[[str], str]) -> set[str]:
    """Batch sizes in rlstack units; model paths that are not local directories."""
    handled: set[str] = set()
    n = int(merged[ROLLOUT + "n"])
    _batch_sizes(merged, given, t, src, n)
    handled |= _dynamic_batch(merged, given, t, src)
    handled |= {
        ACTOR + "ppo_mini_batch_size",
        ACTOR + "ppo_micro_batch_size_per_gpu",
        ACTOR + "ppo_micro_batch_size",
        "critic.ppo_micro_batch_size_per_gpu",
        "critic.ppo_mini_batch_size",
        ROLLOUT + "log_prob_micro_batch_size_per_gpu",
        REF + "log_prob_micro_batch_size_per_gpu",
    }
    for key in (MODEL + "path", "critic.model.path"):
        path = given.get(key)
        if isinstance(path, str) and not os.path.isdir(os.path.expanduser(os.path.expandvars(path))):
            target = "model.path" if key.startswith(MODEL) else "model.critic_path"
            if target in t.sources:
                t.sources[target] += (
                    " -- not a local directory here: rlstack downloads nothing, point it at an HF directory"
                )
    return handled


def _engine(merged: dict, given: dict, t: Translation, src: Callable[[str], str]) -> set[str]:
    """Rollout engine and dtype."""
    handled: set[str] = set()
    engine = given.get(ROLLOUT + "name")
    if engine is not None:
        if engine in ENGINES:
            t.set("rollout.engine", ENGINES[engine], src(ROLLOUT + "name"))
        else:
            t.unsupported.append((f"{ROLLOUT}name={engine}", "rlstack engines: vllm | hf"))
        handled.add(ROLLOUT + "name")
    if merged.get("trainer.device", "cuda") != "cpu":
        t.set("model.dtype", "bfloat16", "verl trains and generates in bf16 on GPUs (set float32 on CPUs)")
    return handled


OVERRIDE_TC = ACTOR + "megatron.override_transformer_config."


def _recompute(merged: dict, given: dict, t: Translation, src: Callable[[str], str]) -> set[str]:
    """verl's megatron activation recompute (`override_transformer_config.recompute_*`)."""
    from rlstack.config import RECOMPUTE_MODULES

    keys = {k[len(OVERRIDE_TC) :]: k for k in given if k.startswith(OVERRIDE_TC + "recompute_")}
    if not keys:
        return set()
    granularity = given.get(keys.get("recompute_granularity", ""))
    method, layers = given.get(keys.get("recompute_method", "")), given.get(keys.get("recompute_num_layers", ""))
    if granularity == "full" and method in (None, "uniform") and layers in (None, 1):
        t.set("model.gradient_checkpointing", True, src(keys["recompute_granularity"]))
    elif granularity == "full":
        why = "rlstack's full recompute checkpoints every layer (recompute_method=uniform, recompute_num_layers=1)"
        t.unsupported.append((f"recompute_method={method} recompute_num_layers={layers}", why))
    elif granularity == "selective":
        # megatron's default module list is ["core_attn"]
        modules = given.get(keys.get("recompute_modules", ""), ["core_attn"])
        modules = [modules] if isinstance(modules, str) else list(modules)
        known = [m for m in modules if m in RECOMPUTE_MODULES]
        if known:
            t.set("model.recompute_modules", known, src(keys.get("recompute_modules", keys["recompute_granularity"])))
        for name in sorted(set(modules) - set(known)):
            t.unsupported.append((f"recompute_modules: {name}", f"rlstack's modules: {', '.join(RECOMPUTE_MODULES)}"))
    return set(keys.values())


# verl 0.9.1 has two LoRA spellings under each model section: the FSDP keys (`lora_rank`, `lora_alpha`,
# `target_modules` with HF module names) and Megatron-Bridge's `lora.*` dict (megatron module names,
# alpha default 32, A init `lora_A_init_method`). rlstack is megatron: `lora.*` wins when both are set.
LORA_SECTIONS = {MODEL: "model.lora", "critic.model.": "critic.lora"}
HF_TO_MEGATRON_LORA = {
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}
MEGATRON_LORA_DEFAULTS = {"alpha": 32}  # verl 0.9.1 `model.lora.alpha`
MEGATRON_LORA_FIXED = {"type": "lora", "lora_B_init_method": "zero", "dropout_position": "pre"}


def _lora(merged: dict, given: dict, t: Translation, src: Callable[[str], str]) -> set[str]:
    """LoRA keys of the actor's and the critic's model sections (both verl spellings)."""
    handled: set[str] = set()
    for prefix, target in LORA_SECTIONS.items():
        handled |= _lora_fsdp(prefix, target, given, t, src)
        handled |= _lora_megatron(prefix, target, given, t, src)
    return handled


def _lora_fsdp(prefix: str, target: str, given: dict, t: Translation, src) -> set[str]:
    keys = {name: prefix + name for name in ("lora_rank", "lora_alpha", "target_modules") if prefix + name in given}
    if "lora_rank" in keys:
        t.set(target + ".rank", int(given[keys["lora_rank"]]), src(keys["lora_rank"]))
    if "lora_alpha" in keys:
        t.set(target + ".alpha", float(given[keys["lora_alpha"]]), src(keys["lora_alpha"]))
    if "target_modules" in keys:
        _lora_targets(given[keys["target_modules"]], target, keys["target_modules"], t, src)
    if prefix + "lora_adapter_path" in given:
        t.unsupported.append((f"{prefix}lora_adapter_path", "rlstack starts LoRA from fresh adapters"))
        keys["lora_adapter_path"] = prefix + "lora_adapter_path"
    return set(keys.values())


def _lora_megatron(prefix: str, target: str, given: dict, t: Translation, src) -> set[str]:
    section = prefix + "lora."
    keys = {k[len(section) :]: k for k in given if k.startswith(section)}
    if "rank" not in keys:
        return set(keys.values())  # without a rank the section does nothing in verl either
    t.set(target + ".rank", int(given[keys["rank"]]), src(keys["rank"]))
    alpha = given.get(keys.get("alpha", ""), MEGATRON_LORA_DEFAULTS["alpha"])
    t.set(
        target + ".alpha", float(alpha), src(keys["alpha"]) if "alpha" in keys else f"verl's default {section}alpha=32"
    )
    if "dropout" in keys:
        t.set(target + ".dropout", float(given[keys["dropout"]]), src(keys["dropout"]))
    if "target_modules" in keys:
        _lora_targets(given[keys["target_modules"]], target, keys["target_modules"], t, src)
    if "lora_A_init_method" in keys:
        init = str(given[keys["lora_A_init_method"]])
        if init in ("xavier", "kaiming", "gaussian"):
            t.set(target + ".init", init, src(keys["lora_A_init_method"]))
        else:
            t.unsupported.append((f"{keys['lora_A_init_method']}={init}", "rlstack's inits: xavier, kaiming, gaussian"))
    for name, value in MEGATRON_LORA_FIXED.items():
        if name in keys and given[keys[name]] != value:
            t.unsupported.append((f"{keys[name]}={_flow(given[keys[name]])}", f"rlstack's LoRA has {name}={value}"))
    for name in ("exclude_modules", "adapter_path"):
        if given.get(keys.get(name, ""), None):
            t.unsupported.append((f"{keys[name]}={_flow(given[keys[name]])}", "no rlstack equivalent"))
    return set(keys.values())


def _lora_targets(value, target: str, key: str, t: Translation, src) -> None:
    """`all-linear`, megatron names, or HF names (q/k/v -> the fused linear_qkv, gate/up -> linear_fc1)."""
    names = list(value) if isinstance(value, (list, tuple)) else [str(value)]
    if "all-linear" in names:
        t.set(target + ".target_modules", "all-linear", src(key))
        return
    mapped = {HF_TO_MEGATRON_LORA.get(n, n) for n in names}
    fused = {"linear_qkv": {"q_proj", "k_proj", "v_proj"}, "linear_fc1": {"gate_proj", "up_proj"}}
    for name, parts in fused.items():
        partial = parts & set(names)
        if partial and partial != parts:
            t.unsupported.append(
                (
                    f"{key}: {', '.join(sorted(partial))}",
                    f"rlstack adapts the fused {name}: {', '.join(sorted(parts))} all",
                )
            )
    order = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    unknown = sorted(mapped - set(order))
    for name in unknown:
        t.unsupported.append((f"{key}: {name}", f"rlstack's LoRA targets: all-linear or {', '.join(order)}"))
    known = [n for n in order if n in mapped]
    if known:
        t.set(target + ".target_modules", known, src(key))


def _data_keys(merged: dict, given: dict, t: Translation, src: Callable[[str], str]) -> set[str]:
    """Prompt-length handling."""
    handled: set[str] = set()
    _data(merged, given, t, src)
    handled |= {"data.truncation", "data.filter_overlong_prompts"}
    return handled


def _rewards(merged: dict, given: dict, t: Translation, src: Callable[[str], str]) -> set[str]:
    """Reward manager and model-based rewards."""
    handled: set[str] = set()
    manager = given.get("reward.reward_manager.name", given.get("reward_model.reward_manager"))
    if manager is not None:
        key = "reward.reward_manager.name" if "reward.reward_manager.name" in given else "reward_model.reward_manager"
        if manager == "batch":
            t.set("data.reward_fn_batched", True, src(key))
        elif manager == "dapo":  # per-sample scores + the overlong buffer (reward.overlong_buffer, below)
            t.ignored.append(
                (
                    f"{key}=dapo",
                    "rlstack scores each sample as the dapo manager does; its overlong "
                    "penalty is reward.overlong_buffer.*",
                )
            )
        elif manager != "naive":
            t.unsupported.append(
                (f"{key}={manager}", "rlstack calls the function per sample (naive) or batched (batch)")
            )
        handled |= {"reward.reward_manager.name", "reward_model.reward_manager"}
    if given.get("reward_model.enable") or given.get("reward.reward_model.enable"):
        t.unsupported.append(
            (
                "reward_model.enable=True",
                "not translated: set reward_model.path to the reward model's HF directory "
                "(verl's reward_model.model.path; see docs/reward_model.md)",
            )
        )
    handled |= {"reward_model.enable", "reward.reward_model.enable"}
    return handled | _dapo(merged, given, t, src)


def _dapo(merged: dict, given: dict, t: Translation, src: Callable[[str], str]) -> set[str]:
    """filter_groups.metric by rlstack's names; the overlong buffer's maximum is rollout.max_new_tokens."""
    handled = {"algorithm.filter_groups.metric", "data.gen_batch_size"}
    metric = given.get("algorithm.filter_groups.metric")
    if metric is not None:
        if metric in FILTER_METRICS:
            t.set("algorithm.filter_groups.metric", FILTER_METRICS[metric], src("algorithm.filter_groups.metric"))
        else:
            t.unsupported.append(
                (
                    f"algorithm.filter_groups.metric={metric}",
                    "rlstack's metrics: acc, score, seq_reward (verl's reward)",
                )
            )
    if "data.gen_batch_size" in given:
        t.unsupported.append(
            (
                f"data.gen_batch_size={given['data.gen_batch_size']}",
                "rlstack generates data.train_batch_size prompts per dynamic-sampling round",
            )
        )
    max_len = merged.get("data.max_response_length")
    for key in ("reward_model.reward_kwargs.max_resp_len", "reward.reward_kwargs.max_resp_len"):
        if key in given:
            handled.add(key)
            if given[key] == max_len:
                t.ignored.append((f"{key}={given[key]}", "the overlong buffer ends at rollout.max_new_tokens"))
            else:
                t.unsupported.append(
                    (
                        f"{key}={given[key]}",
                        f"rlstack's overlong buffer ends at rollout.max_new_tokens (data.max_response_length={max_len})",
                    )
                )
    return handled


def _trainer_keys(merged: dict, given: dict, t: Translation, src: Callable[[str], str]) -> set[str]:
    """Trackers, step counts, validation/save frequency, resume."""
    handled: set[str] = set()
    _trainer(merged, given, t, src)
    handled |= {
        "trainer.logger",
        "trainer.total_epochs",
        "trainer.total_training_steps",
        "trainer.test_freq",
        "trainer.save_freq",
        "trainer.resume_mode",
        "trainer.resume_from_path",
        "trainer.n_gpus_per_node",
        "trainer.nnodes",
    }
    return handled


def _agent_keys(merged: dict, given: dict, t: Translation, src: Callable[[str], str]) -> set[str]:
    """Multi-turn tool settings, the default agent loop and the rollout dump (docs/agents.md)."""
    handled: set[str] = set()
    for key, (target, null) in AGENT_KEYS.items():
        if key in given:
            t.set(target, null if given[key] is None else given[key], src(key))
            handled.add(key)
    key = ROLLOUT + "agent.default_agent_loop"
    if key in given:
        handled.add(key)
        if given[key] in AGENT_LOOPS:
            t.set("rollout.agent_loop", AGENT_LOOPS[given[key]], src(key))
        else:
            t.unsupported.append(
                (f"{key}={_flow(given[key])}", "a verl agent loop: set rollout.agent_loop=FILE.py:Class")
            )
    return handled


ASYNC = "async_training."  # verl's fully-async recipe (recipe/fully_async_policy): docs/placement.md


def _async_keys(merged: dict, given: dict, t: Translation, src: Callable[[str], str]) -> set[str]:
    """verl's fully-async keys where they correspond (docs/placement.md "verl's fully-async keys").

    rollout.n_gpus_per_node x rollout.nnodes: the rollout-only GPUs -> placement.rollout_ranks (added
    to the world). staleness_threshold s and trigger_parameter_sync_step n: verl's rollouter produces
    up to (1 + s) x n updates' worth of samples per weight sync, so the oldest sample trained is up to
    ceil((1 + s) x n) - 1 updates old; rlstack syncs every step, and rollout.staleness bounds exactly
    that age: rollout.staleness = ceil((1 + s) x n) - 1. partial_rollout -> rollout.partial (rlstack
    interrupts the queued batches at each weight push, not at verl's trigger; hf engine only).
    """
    import math

    handled: set[str] = set()
    gpus, nodes = "rollout.n_gpus_per_node", "rollout.nnodes"
    if gpus in given:
        handled |= {gpus, nodes}
        ranks = int(given[gpus]) * int(given.get(nodes) or 1)
        t.world_size += ranks
        t.set("placement.rollout_ranks", ranks, src(gpus) + (f" x {src(nodes)}" if nodes in given else ""))
    threshold, trigger = ASYNC + "staleness_threshold", ASYNC + "trigger_parameter_sync_step"
    if threshold in given or trigger in given:
        handled |= {threshold, trigger}
        s, n = float(given.get(threshold) or 0.0), int(given.get(trigger) or 1)
        names = " and ".join(src(k) for k in (threshold, trigger) if k in given)
        t.set("rollout.staleness", max(0, math.ceil((1 + s) * n) - 1), f"{names}: ceil((1 + s) x n) - 1")
    key = ASYNC + "partial_rollout"
    if key in given:  # rlstack interrupts at weight pushes, with the hf engine (docs/placement.md)
        handled.add(key)
        t.set("rollout.partial", bool(given[key]), src(key) + " (interrupted at each weight push; hf engine only)")
    return handled


def _shared(merged, given, t, src, actor_key, critic_key, target) -> None:
    """rlstack has one value for actor and critic: the actor's wins, a different critic's is noted."""
    if critic_key in given and actor_key not in given:
        t.set(target, given[critic_key], src(critic_key))
    elif critic_key in given and given[critic_key] != merged.get(actor_key):
        t.unsupported.append(
            (
                f"{critic_key}={_flow(given[critic_key])}",
                f"rlstack uses one {target} for actor and critic: took the actor's",
            )
        )


# verl's dynamic batch sizes: a flag and a token budget per pass; rlstack has one budget for all.
DYNAMIC_FLAGS = (ACTOR + "use_dynamic_bsz", "critic.use_dynamic_bsz", ROLLOUT + "log_prob_use_dynamic_bsz")
DYNAMIC_BUDGETS = (
    ACTOR + "ppo_max_token_len_per_gpu",
    "critic.ppo_max_token_len_per_gpu",
    ROLLOUT + "log_prob_max_token_len_per_gpu",
    REF + "log_prob_max_token_len_per_gpu",
)
VERL_MAX_TOKEN_LEN = 16384  # verl 0.9.1's default ppo_max_token_len_per_gpu


def _dynamic_batch(merged: dict, given: dict, t: Translation, src: Callable[[str], str]) -> set[str]:
    """actor.use_dynamic_bsz + ppo_max_token_len_per_gpu -> algorithm.max_tokens_per_micro_batch."""
    flag = ACTOR + "use_dynamic_bsz"
    pp = int(merged.get(ACTOR + "megatron.pipeline_model_parallel_size") or 1)
    if str(given.get(flag, "false")).lower() == "true" and pp > 1:
        t.ignored.append(
            (
                f"{flag}={_flow(given[flag])}",
                f"rlstack's token-budget micro-batches need parallel.pp=1 (pipeline stages exchange one "
                f"micro-batch shape; here pp={pp}): algorithm.micro_batch_size rows instead, same results",
            )
        )
        chosen = 0
    elif str(given.get(flag, "false")).lower() == "true":
        key = ACTOR + "ppo_max_token_len_per_gpu"
        budget = int(given.get(key, VERL_MAX_TOKEN_LEN))
        where = src(key) if key in given else f"verl's default {key}={VERL_MAX_TOKEN_LEN}"
        t.set("algorithm.max_tokens_per_micro_batch", budget, f"{where} ({flag}=true)")
        chosen = budget
    else:
        chosen = 0
    for key in DYNAMIC_BUDGETS[1:] + DYNAMIC_FLAGS[1:]:
        if key in given and chosen and str(given[key]).lower() not in (str(chosen), "true"):
            t.ignored.append(
                (
                    f"{key}={_flow(given[key])}",
                    f"rlstack uses one token budget for every pass (took the actor's {chosen})",
                )
            )
    return set(DYNAMIC_FLAGS) | set(DYNAMIC_BUDGETS)


def _batch_sizes(merged, given, t, src, n: int) -> None:
    prompts = int(merged["data.train_batch_size"])
    mini_key = ACTOR + "ppo_mini_batch_size"
    mini = int(merged[mini_key])
    if mini >= prompts:
        t.set(
            "algorithm.mini_batch_size", 0, src(mini_key) + " prompts >= the train batch: one optimizer step per batch"
        )
    else:
        t.set("algorithm.mini_batch_size", mini * n, src(mini_key) + f" prompts x rollout.n={n} = {mini * n} sequences")
    critic_mini = given.get("critic.ppo_mini_batch_size")
    if critic_mini is not None and int(critic_mini) != mini:
        t.unsupported.append(
            (
                f"critic.ppo_mini_batch_size={critic_mini}",
                "rlstack uses one mini-batch size for actor and critic: took the actor's",
            )
        )
    micro_key = ACTOR + "ppo_micro_batch_size_per_gpu"
    micro = given.get(micro_key)
    if micro is not None:
        t.set("algorithm.micro_batch_size", int(micro), src(micro_key) + " (per rank, as in rlstack)")
        if given.get(ACTOR + "ppo_micro_batch_size") is not None:
            t.ignored.append(
                (
                    f"{ACTOR}ppo_micro_batch_size={_flow(given[ACTOR + 'ppo_micro_batch_size'])}",
                    f"{micro_key}={micro} wins (verl reads the per-GPU size when both are set)",
                )
            )
    elif given.get(ACTOR + "ppo_micro_batch_size") is not None:
        total = int(given[ACTOR + "ppo_micro_batch_size"])
        per_rank = max(1, total // t.world_size)
        t.set(
            "algorithm.micro_batch_size", per_rank, src(ACTOR + "ppo_micro_batch_size") + f" over {t.world_size} GPUs"
        )
    others = [
        k
        for k in (
            "critic.ppo_micro_batch_size_per_gpu",
            ROLLOUT + "log_prob_micro_batch_size_per_gpu",
            REF + "log_prob_micro_batch_size_per_gpu",
        )
        if k in given
    ]
    if "algorithm.micro_batch_size" not in t.values and others:
        t.set("algorithm.micro_batch_size", int(given[others[0]]), src(others[0]))
    chosen = t.values.get("algorithm.micro_batch_size")
    for key in others:
        if int(given[key]) != chosen:
            t.ignored.append(
                (
                    f"{key}={given[key]}",
                    f"rlstack uses one micro-batch size (algorithm.micro_batch_size={chosen}) for every pass",
                )
            )


def _data(merged, given, t, src) -> None:
    truncation = given.get("data.truncation", "error")
    if given.get("data.filter_overlong_prompts"):
        t.set("data.truncation", "drop", src("data.filter_overlong_prompts") + " (too-long prompts are dropped)")
    elif truncation == "error":
        if "data.truncation" in given:
            t.set("data.truncation", "error", src("data.truncation"))
    else:
        t.unsupported.append(
            (
                f"data.truncation={truncation}",
                "rlstack never cuts a prompt: it stops (error) or drops it (data.filter_overlong_prompts=True)",
            )
        )


def _trainer(merged, given, t, src) -> None:
    loggers = merged["trainer.logger"]
    loggers = [loggers] if isinstance(loggers, str) else list(loggers or [])
    trackers = []
    for name in loggers:
        if name in TRACKERS:
            trackers.append(TRACKERS[name])
        else:
            t.unsupported.append((f"trainer.logger={name}", f"rlstack trackers: {', '.join(sorted(TRACKERS))}"))
    if "jsonl" not in trackers:
        trackers.append("jsonl")  # rlstack's metrics.jsonl: plot and benchmarks read it
    t.set("logging.trackers", trackers, src("trainer.logger") + " (+ jsonl, rlstack's metrics file)")
    if given.get("trainer.total_training_steps") is not None:
        t.set("trainer.total_steps", int(given["trainer.total_training_steps"]), src("trainer.total_training_steps"))
    else:
        epochs = int(merged["trainer.total_epochs"])
        rows = _count_rows(merged.get("data.train_files"))
        batch = int(merged["data.train_batch_size"])
        if rows is None:
            t.unsupported.append(
                (
                    f"trainer.total_epochs={epochs}",
                    "the train files cannot be read here to "
                    "count rows: set trainer.total_steps = epochs x rows // data.train_batch_size",
                )
            )
        else:
            steps = max(1, epochs * (rows // batch))
            t.set(
                "trainer.total_steps",
                steps,
                src("trainer.total_epochs") + f" x ({rows} rows // {batch} prompts), as verl's drop-last loader",
            )
    for verl_key, target in (
        ("trainer.test_freq", "trainer.val_every"),
        ("trainer.save_freq", "checkpoint.save_every"),
    ):
        if verl_key in given:
            value = int(given[verl_key])
            t.set(target, max(value, 0), src(verl_key) + (" (-1: never)" if value < 0 else ""))
    mode = given.get("trainer.resume_mode")
    if mode is not None:
        if mode == "auto":
            t.set("checkpoint.resume", "auto", src("trainer.resume_mode"))
        elif mode == "disable":
            t.set("checkpoint.resume", "never", src("trainer.resume_mode"))
        elif mode == "resume_path" and given.get("trainer.resume_from_path"):
            t.set(
                "checkpoint.resume",
                given["trainer.resume_from_path"],
                src("trainer.resume_from_path") + " (an rlstack checkpoint directory: verl's checkpoints do not load)",
            )
        else:
            t.unsupported.append(
                (f"trainer.resume_mode={mode}", "use auto, disable or resume_path with trainer.resume_from_path")
            )
    project, name = given.get("trainer.project_name"), given.get("trainer.experiment_name")
    if project or name:
        t.set(
            "trainer.output_dir",
            os.path.join("outputs", str(project or "rlstack"), str(name or "run")),
            "outputs/<trainer.project_name>/<trainer.experiment_name>",
        )


def _count_rows(files: Any) -> Optional[int]:
    """Rows in the train files (parquet metadata, json/jsonl records); None when one is unreadable."""
    if not files:
        return None
    files = [files] if isinstance(files, str) else list(files)
    total = 0
    for path in files:
        path = os.path.expanduser(os.path.expandvars(str(path)))
        try:
            if path.endswith(".parquet"):
                import pyarrow.parquet as pq

                total += pq.ParquetFile(path).metadata.num_rows
            elif path.endswith(".jsonl"):
                with open(path) as f:
                    total += sum(1 for line in f if line.strip())
            elif path.endswith(".json"):
                import json

                with open(path) as f:
                    total += len(json.load(f))
            else:
                return None
        except (OSError, ValueError, ImportError):
            return None
    return total


# ----------------------------------------------------------------------------- layout, offload, cache

MEGATRON = ACTOR + "megatron."
# verl's megatron layout keys -> rlstack's one layout (actor, critic and reference share it)
LAYOUT = {
    "tensor_model_parallel_size": "parallel.tp",
    "pipeline_model_parallel_size": "parallel.pp",
    "expert_model_parallel_size": "parallel.ep",
}
# verl's megatron offload switches -> rlstack's offload.* (the actor's, which the critic shares)
OFFLOAD = {
    MEGATRON + "param_offload": "offload.params",
    MEGATRON + "optimizer_offload": "offload.optimizer",
    MEGATRON + "grad_offload": "offload.grads",  # verl <= 0.4
    REF + "megatron.param_offload": "offload.reference",
}


def _layout_offload_and_cache(merged: dict, given: dict, t: Translation, src: Callable[[str], str]) -> set[str]:
    """The reference's and critic's megatron layout (rlstack runs them on the actor's), megatron
    offload switches, and the rollout's free_cache_engine."""
    handled: set[str] = set()
    if MEGATRON + "expert_model_parallel_size" in given:
        t.set(
            "parallel.ep",
            int(given[MEGATRON + "expert_model_parallel_size"]),
            src(MEGATRON + "expert_model_parallel_size"),
        )
        handled.add(MEGATRON + "expert_model_parallel_size")
    for role in (REF + "megatron.", "critic.megatron."):
        for name, target in LAYOUT.items():
            key = role + name
            if key not in given:
                continue
            handled.add(key)
            actor = int(given.get(MEGATRON + name) or 1)
            if int(given[key]) != actor:
                t.ignored.append(
                    (
                        f"{key}={_flow(given[key])}",
                        f"rlstack runs every role on one layout: the actor's {target}={actor} "
                        f"({MEGATRON}{name}) wins; only memory per GPU differs, not what is computed",
                    )
                )
    for key, target in OFFLOAD.items():
        if key in given:
            t.set(target, bool(given[key]), src(key))
            handled.add(key)
    for name in ("param_offload", "optimizer_offload", "grad_offload"):
        key, actor_key = "critic.megatron." + name, MEGATRON + name
        if key in given:
            handled.add(key)
            if bool(given[key]) != bool(given.get(actor_key, False)):
                t.ignored.append(
                    (
                        f"{key}={_flow(given[key])}",
                        f"rlstack's {OFFLOAD[actor_key]} covers actor and critic: {actor_key} wins",
                    )
                )
    handled |= _free_cache(given, t, src)
    return handled


# verl 0.9.1's default data files (its GSM8K preprocessing output); `~` expanded, as rlstack reads paths as given
VERL_DATA_FILES = {
    "data.train_files": "~/data/rlhf/gsm8k/train.parquet",
    "data.val_files": "~/data/rlhf/gsm8k/test.parquet",
}


def _default_files(given: dict, t: Translation) -> None:
    """A command line without data files runs on verl's defaults: written out, so the file says what verl reads."""
    for key, path in VERL_DATA_FILES.items():
        if key not in given:
            t.set(key, [os.path.expanduser(path)], f"verl's default {key}={path}")


def _free_cache(given: dict, t: Translation, src: Callable[[str], str]) -> set[str]:
    """verl's rollout.free_cache_engine (free the engine's KV cache between rollouts) is
    rollout.free_cache_during_update with vLLM; the hf engine frees its cache after every generate."""
    key = ROLLOUT + "free_cache_engine"
    if key not in given:
        return set()
    if t.values.get("rollout.engine") == "vllm":
        t.set("rollout.free_cache_during_update", bool(given[key]), src(key))
    else:
        t.ignored.append(
            (
                f"{key}={_flow(given[key])}",
                "rlstack's hf engine frees its cache after every generate (rollout.free_cache_during_update "
                "is vLLM's: set actor_rollout_ref.rollout.name=vllm)",
            )
        )
    return {key}


# ----------------------------------------------------------------------------- verl's own keys

# Names other trainers use for a verl setting (HF Trainer, TRL, OpenRLHF), for "not a verl key" hints.
FOREIGN_NAMES = {
    "max_steps": "trainer.total_training_steps",
    "num_train_epochs": "trainer.total_epochs",
    "learning_rate": ACTOR + "optim.lr",
    "num_generations": ROLLOUT + "n",
    "max_completion_length": "data.max_response_length",
    "max_prompt_length": "data.max_prompt_length",
}


def verl_keys() -> frozenset:
    """Every leaf key of verl 0.9.1's main_ppo config (rlstack/verl_keys.txt), and the keys rlstack's
    tables name from older verl releases."""
    global _VERL_KEYS
    if _VERL_KEYS is None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verl_keys.txt")
        with open(path) as f:
            keys = {line.strip() for line in f if line.strip() and not line.startswith("#")}
        keys |= set(DIRECT) | set(SPECIAL) | set(VERL_DEFAULTS) | set(OFFLOAD)
        keys |= {k.rstrip(".") for k in IGNORED_PREFIXES}
        _VERL_KEYS = frozenset(keys)
    return _VERL_KEYS


_VERL_KEYS: Optional[frozenset] = None


def is_verl_key(key: str) -> bool:
    """`key` or a section above it is a verl key (a key under a free-form mapping such as
    engine_kwargs or override_transformer_config is verl's too)."""
    parts = key.split(".")
    keys = verl_keys()
    return any(".".join(parts[:i]) in keys for i in range(len(parts), 0, -1))


def nearest_verl_key(key: str) -> Optional[str]:
    """The verl key meant by `key`: another trainer's name for it, else the closest spelling."""
    import difflib

    leaf = key.rsplit(".", 1)[-1]
    if leaf in FOREIGN_NAMES:
        return FOREIGN_NAMES[leaf]
    close = difflib.get_close_matches(key, sorted(verl_keys()), n=1, cutoff=0.6)
    return close[0] if close else None


def not_verl_message(key: str) -> str:
    """For a key verl does not have: says so, and names the nearest verl key and its rlstack key."""
    near = nearest_verl_key(key)
    if near is None:
        return "not a verl key (verl 0.9.1's main_ppo has no such setting): check the spelling"
    ours = rlstack_name_for(near)
    return f"not a verl key; verl's is {near}" + (f" (rlstack: {ours})" if ours else "")


# ----------------------------------------------------------------------------- writing


def to_yaml_text(t: Translation, command: str = "") -> str:
    """The rlstack YAML, sections in rlstack's order, one comment per translated key."""
    from rlstack.config import ExperimentConfig, all_config_keys

    order = all_config_keys(ExperimentConfig)
    lines = [
        "# Translated from a verl main_ppo command line by python -m rlstack.from_verl.",
        f"# Launch on {t.world_size} GPU(s): torchrun --nnodes={t.nnodes} "
        f"--nproc_per_node={t.world_size // max(t.nnodes, 1)} -m rlstack.train --config THIS_FILE",
        f"# Check anywhere first: python -m rlstack.train --config THIS_FILE --validate-only "
        f"--world-size {t.world_size}",
    ]
    if command:
        lines.append(f"# verl: {command}")
    path: list[str] = []  # the sections open at the previous line (algorithm, then filter_groups, ...)
    for key in sorted(t.values, key=lambda k: order.index(k) if k in order else len(order)):
        *sections, leaf = key.split(".")
        common = 0
        while common < min(len(path), len(sections)) and path[common] == sections[common]:
            common += 1
        for depth in range(common, len(sections)):
            lines += [""] if depth == 0 else []
            lines.append("  " * depth + f"{sections[depth]}:")
        path = sections
        lines.append("  " * len(sections) + f"{leaf}: {_flow(t.values[key])}  # {t.sources[key]}")
    if t.ignored:
        lines += ["", "# Ignored (no effect on what rlstack computes, or another key sets the same value and wins):"]
        lines += [f"#   {item}: {why}" for item, why in t.ignored]
    if t.unsupported:
        lines += ["", "# UNSUPPORTED (not translated; the run will differ from verl's here):"]
        lines += [f"#   {item}: {why}" for item, why in t.unsupported]
    return "\n".join(lines) + "\n"


def _flow(value: Any) -> str:
    """A value as one line of YAML flow style."""
    return yaml.safe_dump([value], default_flow_style=True, width=10**9).strip()[1:-1]


# ----------------------------------------------------------------------------- CLI


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlstack.from_verl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the YAML here (default: stdout)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when some key is unsupported")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="verl key=value ...")
    args = parser.parse_args(argv)
    tokens = [tok for tok in args.overrides if tok != "--"]
    verl = parse_command_line(tokens)
    if not verl:
        print(
            "from_verl: no verl key=value given: pass main_ppo's overrides, e.g. "
            "data.train_files=train.parquet actor_rollout_ref.model.path=MODEL",
            file=sys.stderr,
        )
        return 2
    t = translate(verl)
    text = to_yaml_text(t, " ".join(f"{k}={_flow(v)}" for k, v in verl.items()))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(
            f"wrote {args.out}: {len(t.values)} rlstack keys, {len(t.ignored)} ignored, "
            f"{len(t.unsupported)} unsupported",
            file=sys.stderr,
        )
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    for item, why in t.unsupported:
        print(f"UNSUPPORTED {item}: {why}", file=sys.stderr)
    return 1 if args.strict and t.unsupported else 0


if __name__ == "__main__":
    sys.exit(main())
