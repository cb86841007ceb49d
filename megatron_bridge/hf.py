"""HF checkpoints <-> Megatron GPTModel stages, at any TP x PP.

Import: each rank builds its own pipeline stage and reads only the rows/columns its TP rank owns,
through `safetensors.safe_open(...).get_slice` (memory-mapped; the whole model is never read per rank).
Export: TP shards are all-gathered, pipeline stages broadcast their tensors in a fixed order
(`mappings.param_maps`), and global rank 0 writes an HF directory that transformers loads as-is.
Process groups come in through `ParallelGroups`; nothing here fetches them from megatron.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from typing import Optional

import torch

from megatron_bridge import layouts
from megatron_bridge.errors import InputError
from megatron_bridge.mappings import (
    ParamMap,
    expert_offset,
    hf_to_megatron_names,
    is_ignored_hf,
    is_seq_cls_config,
    layer_offset,
    megatron_to_hf_names,
    owner_ep,
    owner_stage,
    param_maps,
    score_head_map,
    seq_cls_body_config,
    to_global_name,
    to_local_name,
)
from megatron_bridge.models import Recompute

WEIGHT_SUFFIXES = (
    ".safetensors",
    ".safetensors.index.json",
    ".bin",
    ".bin.index.json",
    ".pt",
    ".pth",
    ".gguf",
    ".msgpack",
    ".h5",
)
SAFE_NAME, INDEX_NAME = "model.safetensors", "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 1024**3


# ---------------------------------------------------------------- paths and config


def local_model_dir(path: str) -> str:
    """A local directory as is; a hub id (`org/name[@revision]`) -> its snapshot in the local HF cache."""
    from megatron_bridge import hub_cache

    if hub_cache.looks_like_hub_id(path):
        return hub_cache.resolve_hub_id(path)
    return path


def resolve_model_path(path: str, tiny_spec=None, cache_dir: Optional[str] = None) -> str:
    """`default` -> the embedded SmolLM2 (provisioned once), `tiny` -> a tiny random model, a hub id ->
    its snapshot in the local Hugging Face cache (never downloaded), else an HF dir."""
    if path == "default":
        from megatron_bridge.default_model import ensure_default_model

        return ensure_default_model(cache_dir)
    if path == "tiny":
        from megatron_bridge.tiny import TinySpec, ensure_tiny_checkpoint

        spec = tiny_spec if isinstance(tiny_spec, TinySpec) else TinySpec(**(tiny_spec or {}))
        return ensure_tiny_checkpoint(spec, cache_dir=cache_dir)
    path = local_model_dir(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise InputError(
            f"model path {path!r} is not an HF checkpoint directory (no config.json): pass a directory saved "
            f"with save_pretrained, a hub id cached locally, `default` (embedded SmolLM2-135M-Instruct) or `tiny`"
        )
    return path


def read_hf_config(hf_dir: str) -> dict:
    from megatron_bridge.hf_config import read_hf_config as read

    return read(hf_dir)


def read_model_args(hf_dir: str):
    """The decoder's ModelArgs; a 1-label `*ForSequenceClassification` (reward model) reads as its body."""
    from megatron_bridge.models import ModelArgs

    config = read_hf_config(hf_dir)
    if is_seq_cls_config(config):
        config = seq_cls_body_config(config, os.path.join(hf_dir, "config.json"))
    return ModelArgs.from_hf_config(config)


def is_seq_cls_dir(hf_dir: str) -> bool:
    """Is `hf_dir` a sequence-classification checkpoint (a reward model, or a critic exported as one)?"""
    return is_seq_cls_config(read_hf_config(hf_dir))


def check_layout(args, dims) -> None:
    """TP must divide heads and query groups, PP the layers (ValueError naming the fix)."""
    dims.check_model(args)


# ---------------------------------------------------------------- reading slices


class SafetensorsReader:
    """HF tensors by name from model.safetensors or a sharded index, read by slice."""

    def __init__(self, hf_dir: str):
        self.hf_dir = hf_dir
        self.files = self._weight_map(hf_dir)  # name -> file
        self._open: dict[str, object] = {}

    @staticmethod
    def _weight_map(hf_dir: str) -> dict[str, str]:
        from safetensors import safe_open

        index = os.path.join(hf_dir, INDEX_NAME)
        if os.path.isfile(index):
            with open(index) as f:
                return dict(json.load(f)["weight_map"])
        single = os.path.join(hf_dir, SAFE_NAME)
        if not os.path.isfile(single):
            raise InputError(
                f"{hf_dir} has neither {SAFE_NAME} nor {INDEX_NAME}: re-save the model with "
                f"save_pretrained(..., safe_serialization=True)"
            )
        with safe_open(single, framework="pt") as f:
            return {name: SAFE_NAME for name in f.keys()}

    def _slice(self, name: str):
        from safetensors import safe_open

        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(os.path.join(self.hf_dir, file), framework="pt")
        return self._open[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, piece: layouts.Piece) -> torch.Tensor:
        """Only the owned rows/columns are read from disk."""
        s = self._slice(name)
        if piece.dim is None:
            return s[:]
        if piece.dim == 0:
            return s[piece.start : piece.stop]
        return s[:, piece.start : piece.stop]


def check_hf_tensors(reader: SafetensorsReader, args, te_spec: bool = False, extra: tuple[ParamMap, ...] = ()) -> None:
    """Every tensor the mapping needs is present with its expected shape, and nothing is left over.

    `extra`: maps outside the decoder declaration the caller also reads (a classifier's `score.weight`)."""
    by_hf = hf_to_megatron_names(args, te_spec)
    for m in extra:
        by_hf.update({name: [(m, i)] for i, name in enumerate(m.hf)})
    missing = sorted(n for n in by_hf if n not in reader.files)
    if missing:
        raise InputError(
            f"{reader.hf_dir} lacks {len(missing)} tensor(s) the {args.arch} mapping needs: "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}: is it a complete checkpoint?"
        )
    tied_extra = {"lm_head.weight"} if args.tie_word_embeddings else set()  # a tied copy some tools save
    unused = sorted(n for n in reader.files if n not in by_hf and n not in tied_extra and not is_ignored_hf(n))
    if unused:
        raise InputError(
            f"{reader.hf_dir} has tensor(s) the {args.arch} mapping does not use: "
            f"{', '.join(unused[:8])}: this model variant is not supported by the bridge"
        )
    for name, uses in by_hf.items():
        m, i = uses[0]
        if reader.shape(name) != m.hf_shapes[i]:
            raise InputError(
                f"shape mismatch for {name}: checkpoint {list(reader.shape(name))}, config.json "
                f"implies {list(m.hf_shapes[i])}: the config and the weights disagree"
            )


# ---------------------------------------------------------------- import


def uses_te_spec(model) -> bool:
    return any(n.endswith("layer_norm_weight") for n, _ in model.named_parameters())


def load_hf_weights(
    model,
    hf_dir: str,
    args,
    groups,
    te_spec: Optional[bool] = None,
    divisible_by: int = 128,
    skip: tuple[str, ...] = (),
    score_head: bool = False,
) -> None:
    """Fill one pipeline stage's GPTModel in place from an HF checkpoint, reading only owned slices.

    `skip`: local parameter names left alone (e.g. a value head's `output_layer.weight`).
    `score_head`: the checkpoint is a sequence classifier; its `score.weight` fills the value head.
    """
    te_spec = uses_te_spec(model) if te_spec is None else te_spec
    reader = SafetensorsReader(hf_dir)
    extra = (score_head_map(args),) if score_head else ()
    check_hf_tensors(reader, args, te_spec, extra)
    maps = megatron_to_hf_names(args, te_spec)
    if score_head and groups.is_last_stage:
        maps[score_head_map(args).megatron] = score_head_map(args)
        skip = tuple(n for n in skip if n != score_head_map(args).megatron)
    offset = layer_offset(args, groups.pp_rank, groups.dims.pp)
    e_offset = expert_offset(args, groups.ep_rank, groups.dims.ep)  # this EP rank's experts only
    tp_rank, tp_size = groups.tp_rank, groups.dims.tp
    with torch.no_grad():
        for local_name, param in model.named_parameters():
            if local_name in skip:
                continue
            m = maps.get(to_global_name(local_name, offset, e_offset))
            assert m is not None, f"megatron parameter {local_name} has no rule in the {args.arch} mapping"
            pieces = layouts.megatron_pieces(m.transform, m.hf_shapes, tp_rank, tp_size, args, divisible_by)
            parts = [reader.read(name, piece) for name, piece in zip(m.hf, pieces)]
            shard = layouts.megatron_pack(m.transform, parts, tp_size, args, divisible_by)
            if shard.shape != param.shape:
                raise ValueError(
                    f"shape mismatch for {local_name} (from {', '.join(m.hf)}): HF gives "
                    f"{list(shard.shape)}, the Megatron model has {list(param.shape)}"
                )
            param.copy_(shard)


def build_megatron_from_hf(
    hf_dir: str,
    groups,
    dtype: torch.dtype = torch.float32,
    value_head: bool = False,
    recompute: Recompute = False,
    value_head_seed: int = 0,
):
    """This rank's pipeline stage of the HF model as a Megatron GPTModel -> (model, args).

    With `value_head`, the last stage's scalar head is initialised from `value_head_seed` when the HF
    checkpoint has no such head, and read from its `score.weight` when it is a 1-label
    `*ForSequenceClassification` (a reward model, or a critic exported in that form)."""
    from megatron_bridge.models import ValueHead, build_stage, init_value_head_

    hf_dir = local_model_dir(hf_dir)  # e.g. a critic_path given as a cached hub id
    args = read_model_args(hf_dir)
    score_head = is_seq_cls_dir(hf_dir)
    if score_head and not value_head:
        raise InputError(
            f"{hf_dir} is a sequence-classification checkpoint (no LM head): use it as "
            "reward_model.path or model.critic_path, not as a language model"
        )
    check_layout(args, groups.dims)
    model = build_stage(args, groups, dtype=dtype, recompute=recompute, value_head=value_head)
    has_value_head = isinstance(getattr(model, "output_layer", None), ValueHead)
    skip = ("output_layer.weight",) if has_value_head else ()
    load_hf_weights(model, hf_dir, args, groups, skip=skip, score_head=score_head)
    if has_value_head and not score_head:
        init_value_head_(model.output_layer, seed=value_head_seed)
    return model, args


# ---------------------------------------------------------------- export


def export_maps(args, te_spec: bool = False) -> list[ParamMap]:
    return [m for m in param_maps(args, te_spec) if m.export]


def iter_hf_tensors(model, args, groups, te_spec: Optional[bool] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) on every rank of this model replica, one parameter at a time.

    Collective over the replica's TP, PP (and EP) groups: all its ranks iterate together. Peak extra
    memory is one full parameter (the largest: the embedding). A routed expert is broadcast from the
    EP rank that holds it, after its own TP gather and pipeline broadcast.
    """
    import torch.distributed as dist

    te_spec = uses_te_spec(model) if te_spec is None else te_spec
    local = dict(model.named_parameters())
    offset = layer_offset(args, groups.pp_rank, groups.dims.pp)
    e_offset = expert_offset(args, groups.ep_rank, groups.dims.ep)
    some = next(iter(local.values()))
    for m in export_maps(args, te_spec):
        owner = owner_stage(m, args, groups.dims.pp)
        ep_owner = owner_ep(m, args, groups.dims.ep)
        mine = ep_owner is None or ep_owner == groups.ep_rank
        if owner == groups.pp_rank and mine:
            tensors = _gather_tp(local[to_local_name(m.megatron, offset, e_offset)], m, args, groups)
        else:
            tensors = [torch.empty(s, dtype=some.dtype, device=some.device) for s in m.hf_shapes]
        if groups.dims.pp > 1 and mine:
            src = dist.get_global_rank(groups.pp, owner)
            for t in tensors:
                dist.broadcast(t, src=src, group=groups.pp)
        if ep_owner is not None and groups.dims.ep > 1:
            src = dist.get_global_rank(groups.ep, ep_owner)
            for t in tensors:
                dist.broadcast(t, src=src, group=groups.ep)
        yield from zip(m.hf, tensors)


def _gather_tp(param: torch.Tensor, m: ParamMap, args, groups) -> list[torch.Tensor]:
    import torch.distributed as dist

    shard = param.detach().contiguous()
    if groups.dims.tp == 1 or m.transform == "replicate":
        shards = [shard]
    else:
        shards = [torch.empty_like(shard) for _ in range(groups.dims.tp)]
        dist.all_gather(shards, shard, group=groups.tp)
    return [t.contiguous() for t in layouts.megatron_unshard(m.transform, shards, args)]


def gather_hf_state_dict(model, args, groups) -> Optional[dict[str, torch.Tensor]]:
    """Full HF-named CPU tensors on global rank 0, None elsewhere. Every rank must call it."""
    if groups.dp_rank >= groups.dims.ep:
        return None  # replicas hold the same weights; the first one (its EP group of DP ranks) exports
    out = {}
    for name, tensor in iter_hf_tensors(model, args, groups):
        if groups.rank == 0:
            out[name] = tensor.cpu()
    return out if groups.rank == 0 else None


def save_hf(
    state_dict: dict[str, torch.Tensor], args, out_dir: str, source_hf_dir: str, max_shard_bytes: int = MAX_SHARD_BYTES
) -> str:
    """Write an HF directory: config.json and tokenizer files copied from the source, safetensors weights.

    A tied output embedding is stored once (as transformers does); a checkpoint larger than
    `max_shard_bytes` is split into shards with an index.
    """
    if args.tie_word_embeddings:
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    expected = {n for m in export_maps(args) for n in m.hf}
    missing = sorted(expected - set(state_dict))
    if missing:
        raise ValueError(f"state dict lacks {len(missing)} tensor(s): {', '.join(missing[:8])}")
    os.makedirs(out_dir, exist_ok=True)
    copy_side_files(source_hf_dir, out_dir)
    _write_safetensors({k: v.detach().cpu().contiguous() for k, v in state_dict.items()}, out_dir, max_shard_bytes)
    return out_dir


def copy_side_files(source_hf_dir: str, out_dir: str) -> None:
    """config.json, generation config, tokenizer (fast or SentencePiece), chat template: all but weights."""
    source_hf_dir = local_model_dir(source_hf_dir)
    for name in sorted(os.listdir(source_hf_dir)):
        path = os.path.join(source_hf_dir, name)
        if name.startswith(".") or not os.path.isfile(path) or name.endswith(WEIGHT_SUFFIXES):
            continue
        shutil.copyfile(path, os.path.join(out_dir, name))


def _write_safetensors(state_dict: dict[str, torch.Tensor], out_dir: str, max_shard_bytes: int) -> None:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, SAFE_NAME), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
        total += sum(t.numel() * t.element_size() for t in shard.values())
    with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
