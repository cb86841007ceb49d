"""HF checkpoint <-> Megatron distributed checkpoint, at any TP x PP (x EP for a MoE).

    python -m megatron_bridge.convert --hf-in DIR --mcore-out DIR --tp N --pp M [--ep E]
    python -m megatron_bridge.convert --mcore-in DIR --hf-out DIR [--tp N --pp M --ep E]

Run as a plain command it spawns TP x PP x EP local ranks itself (gloo on CPU, NCCL with GPUs; the
EP ranks are data-parallel ranks that split the experts); under torchrun it uses the launched world,
which must be TP x PP x EP ranks. A Megatron output directory holds
`mcore/` (megatron.core.dist_checkpointing), `hf/` (config.json and tokenizer files of the source)
and `bridge_layout.json` (TP, PP, HF config), written last: its presence marks a complete checkpoint.
Export reads the layout from `bridge_layout.json`; `--tp/--pp/--ep` there only override it (dist
checkpoints reshard on load).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

from megatron_bridge.errors import InputError

LAYOUT_FILE = "bridge_layout.json"
MCORE_SUBDIR, HF_SUBDIR = "mcore", "hf"
LAYOUT_VERSION = 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_bridge.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-in", help="HF checkpoint directory (or `default`, `tiny`) to import")
    p.add_argument("--mcore-out", help="directory for the Megatron dist checkpoint (empty or new)")
    p.add_argument("--mcore-in", help="Megatron checkpoint directory written by --mcore-out")
    p.add_argument("--hf-out", help="directory for the exported HF checkpoint")
    p.add_argument("--tp", type=int, default=None, help="tensor parallel size (import: default 1)")
    p.add_argument("--pp", type=int, default=None, help="pipeline parallel size (import: default 1)")
    p.add_argument("--ep", type=int, default=None, help="expert parallel size, MoE only (import: default 1)")
    p.add_argument("--cache-dir", default=None, help="where `default`/`tiny` checkpoints are provisioned")
    return p


def check_options(opts) -> str:
    """'import' or 'export'; a ValueError names the missing or conflicting flag."""
    if opts.hf_in and opts.mcore_out and not (opts.mcore_in or opts.hf_out):
        return "import"
    if opts.mcore_in and opts.hf_out and not (opts.hf_in or opts.mcore_out):
        return "export"
    raise InputError("pass either --hf-in DIR --mcore-out DIR [--tp N --pp M] or --mcore-in DIR --hf-out DIR")


def read_layout(mcore_dir: str) -> dict:
    path = os.path.join(mcore_dir, LAYOUT_FILE)
    if not os.path.isfile(path):
        raise InputError(
            f"{mcore_dir} has no {LAYOUT_FILE}: pass a directory written by "
            f"`python -m megatron_bridge.convert --mcore-out` (an interrupted conversion leaves none)"
        )
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------- per-rank work


def import_rank(hf_dir: str, out_dir: str, groups) -> dict:
    """This rank's stage from HF, saved into the shared dist checkpoint."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_bridge.hf import build_megatron_from_hf, copy_side_files, read_hf_config

    start = time.time()
    model, _ = build_megatron_from_hf(hf_dir, groups)
    loaded = time.time()
    ckpt = os.path.join(out_dir, MCORE_SUBDIR)
    if groups.rank == 0:
        os.makedirs(ckpt, exist_ok=True)
        os.makedirs(os.path.join(out_dir, HF_SUBDIR), exist_ok=True)
        copy_side_files(hf_dir, os.path.join(out_dir, HF_SUBDIR))
    dist.barrier(group=groups.world)
    dist_checkpointing.save(model.sharded_state_dict(), ckpt)
    dist.barrier(group=groups.world)
    if groups.rank == 0:
        layout = {
            "version": LAYOUT_VERSION,
            "tp": groups.dims.tp,
            "pp": groups.dims.pp,
            "ep": groups.dims.ep,
            "hf_config": read_hf_config(hf_dir),
            "source": os.path.abspath(hf_dir),
        }
        with open(os.path.join(out_dir, LAYOUT_FILE), "w") as f:
            json.dump(layout, f, indent=2)
    return {"load_s": loaded - start, "save_s": time.time() - loaded}


def load_mcore_checkpoint(model, ckpt_dir: str) -> None:
    """Fill a built stage from a dist checkpoint (any saved TP/PP: megatron reshards on load)."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    model.load_state_dict(state)


def export_rank(mcore_dir: str, hf_out: str, groups) -> dict:
    """This rank's stage from the dist checkpoint; rank 0 writes the HF directory."""
    from megatron_bridge.hf import check_layout, gather_hf_state_dict, save_hf
    from megatron_bridge.models import ModelArgs, build_gpt, transformer_config

    layout = read_layout(mcore_dir)
    args = ModelArgs.from_hf_config(layout["hf_config"])
    check_layout(args, groups.dims)
    start = time.time()
    config = transformer_config(args, groups.dims.tp, groups.dims.pp, ep=groups.dims.ep)
    model = build_gpt(
        args,
        config,
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        padded_vocab=args.padded_vocab_size(groups.dims.tp),
    )
    load_mcore_checkpoint(model, os.path.join(mcore_dir, MCORE_SUBDIR))
    loaded = time.time()
    state = gather_hf_state_dict(model, args, groups)
    if state is not None:
        save_hf(state, args, hf_out, os.path.join(mcore_dir, HF_SUBDIR))
    return {"load_s": loaded - start, "save_s": time.time() - loaded}


def run_rank(mode: str, opts) -> dict:
    """One rank: init groups, convert, report seconds and peak memory (collected on rank 0)."""
    import torch
    import torch.distributed as dist

    from megatron_bridge import patches
    from megatron_bridge.parallel import destroy_distributed, init_distributed

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    patches.apply()
    groups = init_distributed(opts.tp, opts.pp, ep=opts.ep)
    try:
        if mode == "import":
            stats = import_rank(opts.hf_in, opts.mcore_out, groups)
        else:
            stats = export_rank(opts.mcore_in, opts.hf_out, groups)
        stats["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        everyone = [None] * groups.dims.world_size
        dist.all_gather_object(everyone, stats, group=groups.world)
    finally:
        destroy_distributed()
    if groups.rank == 0:
        for rank, s in enumerate(everyone):
            print(
                f"rank {rank}: load_s={s['load_s']:.1f} save_s={s['save_s']:.1f} peak_rss_mib={s['peak_rss_mib']:.0f}",
                flush=True,
            )
    return stats


# ---------------------------------------------------------------- launching


def _spawned_rank(local_rank: int, world_size: int, port: int, threads: int, mode: str, opts) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": str(threads),
        }
    )
    run_rank(mode, opts)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(opts) -> str:
    """Validate flags and paths before any process starts; fill --tp/--pp/--ep."""
    from megatron_bridge.hf import check_layout, read_model_args, resolve_model_path
    from megatron_bridge.models import ModelArgs
    from megatron_bridge.parallel import ParallelDims

    mode = check_options(opts)
    if mode == "import":
        opts.hf_in = resolve_model_path(opts.hf_in, cache_dir=opts.cache_dir)
        if os.path.exists(os.path.join(opts.mcore_out, LAYOUT_FILE)):
            raise InputError(f"{opts.mcore_out} already holds a checkpoint: choose a new --mcore-out directory")
        opts.tp, opts.pp, opts.ep = opts.tp or 1, opts.pp or 1, opts.ep or 1
        args = read_model_args(opts.hf_in)
    else:
        layout = read_layout(opts.mcore_in)
        opts.tp, opts.pp = opts.tp or layout["tp"], opts.pp or layout["pp"]
        opts.ep = opts.ep or layout.get("ep", 1)
        args = ModelArgs.from_hf_config(layout["hf_config"])
    world = opts.tp * opts.pp * opts.ep  # data parallel = EP: one replica, its experts split
    check_layout(args, ParallelDims.resolve(opts.tp, opts.pp, opts.ep, world, ep=opts.ep))
    return mode


def main(argv=None) -> int:
    parser = build_parser()
    opts = parser.parse_args(argv)
    try:
        mode = prepare(opts)
    except InputError as e:  # a user mistake: one line naming the fix, exit status 2
        parser.error(str(e))
    world = opts.tp * opts.pp * opts.ep
    if "WORLD_SIZE" in os.environ:  # under torchrun
        if int(os.environ["WORLD_SIZE"]) != world:
            raise InputError(
                f"launched {os.environ['WORLD_SIZE']} ranks for TP*PP*EP={world}: use "
                f"--nproc_per_node={world} or run without torchrun"
            )
        run_rank(mode, opts)
        return 0
    import torch.multiprocessing as mp

    threads = max(1, (os.cpu_count() or 1) // world)
    start = time.time()
    mp.start_processes(
        _spawned_rank, args=(world, free_port(), threads, mode, opts), nprocs=world, start_method="spawn"
    )
    print(f"{mode} done in {time.time() - start:.1f}s: {opts.mcore_out or opts.hf_out}", flush=True)
    return 0


if __name__ == "__main__":  # dist checkpointing spawns a manager: the guard keeps it from re-running main
    from megatron_bridge.fast_exit import run_main

    run_main(main)
