"""Training checkpoint -> HF safetensors directory, through the bridge.

    python -m rlstack.export --ckpt outputs/run/checkpoints --out hf_actor [--critic]
    torchrun --nproc_per_node=2 -m rlstack.export --ckpt ... --out ... --tp 2   # big models

`--ckpt` is one checkpoint (`.../step_N`) or a checkpoints folder (its newest complete one); an
incomplete checkpoint is refused. The actor becomes a `*ForCausalLM` directory that transformers
loads as-is. With `--critic`, the critic becomes a `*ForTokenClassification` directory with one
label (`score.weight` = the value head, no bias), whose per-token logits are the critic's values;
with `--critic-format seq-cls` a `*ForSequenceClassification` one instead (num_labels=1, the same
`score.weight`, pad_token_id set), the reward-model format: `reward_model.path` or
`model.critic_path` of a later run loads it, and transformers scores the last non-pad token.
LoRA (docs/lora.md): a checkpoint of a `model.lora` run holds the adapters only; the actor is
exported as a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`, for
`peft.PeftModel.from_pretrained(<base HF model>, out)`), or with `--merge` as the base HF model with
the adapters merged in. The base is the HF checkpoint the run started from (recorded in
trainer_state.json; `--base` names another copy of it).
Weights come from the checkpoint's dist-checkpoint shards, resharded on load to `--tp/--pp`
(default 1 x 1: one process is enough); config and tokenizer files come from the copy of the
starting HF checkpoint stored inside the checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from typing import Optional

from rlstack.errors import UserError

log = logging.getLogger("rlstack")
CRITIC_FORMATS = ("token-cls", "seq-cls")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m rlstack.export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ckpt", required=True, help="checkpoint directory (step_N) or checkpoints folder")
    parser.add_argument("--out", required=True, help="HF directory to write the actor to")
    parser.add_argument("--critic", action="store_true", help="also export the critic (PPO runs)")
    parser.add_argument("--critic-out", default="", help="critic HF directory (default: <out>-critic)")
    parser.add_argument(
        "--critic-format",
        choices=CRITIC_FORMATS,
        default="token-cls",
        help="token-cls: *ForTokenClassification (values per token); seq-cls: *ForSequenceClassification "
        "(num_labels=1, the reward-model format)",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size to load at")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size to load at")
    parser.add_argument("--force", action="store_true", help="write into non-empty --out/--critic-out directories")
    parser.add_argument(
        "--merge", action="store_true", help="LoRA checkpoints: write the merged HF model instead of the PEFT adapter"
    )
    parser.add_argument("--base", default="", help="LoRA checkpoints: the base HF directory (default: the run's)")
    return parser.parse_args(argv)


def export_checkpoint(
    ckpt: str,
    out: str,
    critic_out: Optional[str] = None,
    tp: int = 1,
    pp: int = 1,
    groups=None,
    critic_format: str = "token-cls",
    merge: bool = False,
    base: str = "",
) -> dict:
    """Write the actor (and the critic when `critic_out`) as HF directories. Collective; returns paths.
    A LoRA actor becomes a PEFT adapter directory, or (`merge`) the merged HF model."""
    from megatron_bridge.parallel import init_distributed
    from rlstack.checkpoint import resolve_path

    path = resolve_path(ckpt, "--ckpt")
    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    roles, lora = state["roles"], state.get("lora") or {}
    if critic_out and "critic" not in roles:
        raise UserError(f"checkpoint {path} has no critic (a GRPO run?): drop --critic")
    if critic_out and lora.get("critic"):
        raise UserError(f"checkpoint {path} has a LoRA critic, which export does not write yet: drop --critic")
    if (merge or base) and not lora.get("actor"):
        raise UserError(f"checkpoint {path} is not a LoRA run: drop --merge / --base")
    if groups is None:
        from megatron_bridge import patches

        patches.apply()
        groups = init_distributed(tp, pp, backend="auto")
    if lora.get("actor"):
        written = {"actor": _export_lora_actor(path, out, groups, lora["actor"], merge, base)}
    else:
        written = {"actor": _export_role(path, "actor", out, groups)}
    if critic_out:
        written["critic"] = _export_role(path, "critic", critic_out, groups, critic_format)
    return written


def _export_role(path: str, role: str, out: str, groups, critic_format: str = "token-cls") -> Optional[str]:
    from megatron_bridge.hf import gather_hf_state_dict, read_model_args, save_hf
    from rlstack import collectives
    from rlstack.checkpoint import HF_SOURCE, load_model_weights

    source = os.path.join(path, HF_SOURCE, role)
    args = read_model_args(source)
    value_head = role == "critic"
    model = _build_empty(args, groups, value_head)
    load_model_weights(model, os.path.join(path, role))
    if value_head:
        # The value head replaces the LM head: export the body as if tied (no lm_head rule),
        # then add the head as `score.weight`.
        body_args = dataclasses.replace(args, tie_word_embeddings=True)
        state = gather_hf_state_dict(model, body_args, groups)
        head = _value_head_on_rank0(model, args, groups)
        if state is not None:
            state["score.weight"] = head
    else:
        state = gather_hf_state_dict(model, args, groups)
    if state is not None:
        save_hf(state, body_args if value_head else args, out, source)
        if value_head and critic_format == "seq-cls":
            _write_sequence_classification_config(out)
        elif value_head:
            _write_token_classification_config(out)
        log.info("exported the %s of %s to %s", role, path, out)
    collectives.barrier(groups.world, groups.device)
    return out if state is not None else None


# ----------------------------------------------------------------------------- LoRA


def export_peft_adapter(adapters: dict, base_hf_dir: str, out: str, alpha: float, dropout: float = 0.0) -> str:
    """LoRA adapters in megatron layout (`megatron_bridge.lora.adapter_state`: global name -> TP1
    tensor) -> a PEFT adapter directory that `peft.PeftModel.from_pretrained(<base HF model>, out)`
    loads. Runs on one process (the caller gathers the adapters first)."""
    from megatron_bridge.hf import read_model_args
    from megatron_bridge.lora_export import write_peft_adapter

    args = read_model_args(base_hf_dir)
    write_peft_adapter(out, adapters, args, alpha, dropout, base_model=os.path.abspath(base_hf_dir))
    log.info("exported a PEFT LoRA adapter (%d tensors) to %s", len(adapters), out)
    return out


def export_merged(adapters: dict, base_hf_dir: str, out: str, scale: float) -> str:
    """The base HF checkpoint with every adapter merged in (W + scale * B @ A, scale = alpha / rank):
    a plain HF directory (config and tokenizer copied from `base_hf_dir`). One process."""
    from megatron_bridge.hf import SafetensorsReader, read_model_args, save_hf
    from megatron_bridge.layouts import WHOLE
    from megatron_bridge.lora_export import merged_hf_state

    args = read_model_args(base_hf_dir)
    reader = SafetensorsReader(base_hf_dir)
    base = {name: reader.read(name, WHOLE) for name in reader.files}
    save_hf(merged_hf_state(base, adapters, args, scale), args, out, base_hf_dir)
    log.info("exported the base model with LoRA merged in to %s", out)
    return out


def _export_lora_actor(path: str, out: str, groups, record: dict, merge: bool, base: str) -> Optional[str]:
    """The adapters of a LoRA checkpoint (resharded to this layout, gathered) -> PEFT dir or merged model."""
    from megatron_bridge.hf import read_model_args
    from megatron_bridge.lora import LoraSpec, adapter_state, add_lora_
    from megatron_bridge.mappings import layer_offset
    from rlstack import collectives
    from rlstack.checkpoint import HF_SOURCE, load_model_weights

    base = base or record["base"]
    if not os.path.exists(os.path.join(base, "config.json")):
        raise UserError(f"the LoRA base model {base} is not on this machine: pass --base <its HF directory>")
    args = read_model_args(os.path.join(path, HF_SOURCE, "actor"))
    fields = ("rank", "alpha", "dropout", "init", "seed")
    spec = LoraSpec(**{k: record[k] for k in fields}, target_modules=tuple(record["target_modules"]))
    model = _build_empty(args, groups, value_head=False)
    offset = layer_offset(args, groups.pp_rank, groups.dims.pp)
    add_lora_(model, spec, groups.tp, offset)
    load_model_weights(model, os.path.join(path, "actor"))
    adapters = adapter_state(model, groups.tp, groups.pp, offset)  # collective: every rank gets them
    if groups.rank == 0:
        if merge:
            export_merged(adapters, base, out, spec.scale)
        else:
            export_peft_adapter(adapters, base, out, spec.alpha, spec.dropout)
    collectives.barrier(groups.world, groups.device)
    return out if groups.rank == 0 else None


def _build_empty(args, groups, value_head: bool):
    """One pipeline stage without initialising weights: the checkpoint fills every parameter."""
    from megatron_bridge.models import build_stage

    return build_stage(args, groups, value_head=value_head)


def _value_head_on_rank0(model, args, groups):
    """The value head weight [1, H] (replicated over TP) from the last pipeline stage, on every stage."""
    import torch

    from rlstack import collectives

    if groups.is_last_stage:
        head = model.output_layer.weight.detach().clone()
    else:
        head = torch.empty((1, args.hidden_size), dtype=model.config.params_dtype, device=groups.device)
    if groups.dims.pp > 1:
        collectives.broadcast_(head, collectives.src_of_last(groups.pp), groups.pp, groups.device)
    return head.cpu()


def _write_token_classification_config(out: str) -> None:
    config_path = os.path.join(out, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    arch = config["architectures"][0].replace("ForCausalLM", "ForTokenClassification")
    config.update(
        architectures=[arch],
        num_labels=1,
        id2label={"0": "VALUE"},
        label2id={"VALUE": 0},
        token_classification_bias=False,
        tie_word_embeddings=False,
    )
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def _write_sequence_classification_config(out: str) -> None:
    """The reward-model form: transformers reads `score` at the last non-pad token, so pad_token_id is set."""
    config_path = os.path.join(out, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    arch = config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")
    eos = config.get("eos_token_id")
    pad = config.get("pad_token_id")
    config.update(
        architectures=[arch],
        num_labels=1,
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
        pad_token_id=pad if pad is not None else (eos[0] if isinstance(eos, list) else eos),
        tie_word_embeddings=False,
    )
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def main(argv=None) -> int:
    from rlstack.observability.logging import setup_logging, user_error_guard

    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logger = setup_logging(None, rank)
    return user_error_guard(lambda: _run(args), rank, logger)


def _run(args) -> int:
    from megatron_bridge.parallel import destroy_distributed

    critic_out = (args.critic_out or args.out.rstrip("/") + "-critic") if args.critic else None
    for flag, out in (("--out", args.out), ("--critic-out", critic_out)):
        _check_out_dir(flag, out, args.force)
    try:
        written = export_checkpoint(
            args.ckpt,
            args.out,
            critic_out,
            tp=args.tp,
            pp=args.pp,
            critic_format=args.critic_format,
            merge=args.merge,
            base=args.base,
        )
    finally:
        destroy_distributed()
    for role, out in written.items():
        if out:
            print(f"{role}: {out}")
    return 0


def _check_out_dir(flag: str, out: Optional[str], force: bool) -> None:
    """Never write over an existing directory's files unless asked to (--force)."""
    if not out or not os.path.exists(out):
        return
    if not os.path.isdir(out):
        raise UserError(f"{flag} {out} is a file: pass a directory path")
    if os.listdir(out) and not force:
        raise UserError(f"{flag} {out} is not empty: choose a new directory, or pass --force to write into it")


if __name__ == "__main__":  # dist checkpointing spawns a process: keep the guard
    from megatron_bridge.fast_exit import run_main

    run_main(main)
