"""Where one rank's memory goes in the actor's update: SmolLM2-135M, fp32, one process (DP1).

    PYTHONPATH=. .venv/bin/python benchmarks/actor_memory.py [--seqs 32] [--seq-len 100] [--micro 8]

Each variant runs in a fresh process and reports RSS at each point (MiB): the runtime after
imports, the role built (weights + fp32 grad buffer), after the first optimizer step (+ Adam
state), and the peak of a second update (VmHWM reset just before it). Variants: `fused` (the
default: the LM head multiplied inside the log-prob, model.fused_output_logprobs), `new` (the
chunked, recomputing log-prob on the model's logits) and `old` (the function it replaced, the
oracle of tests/distributed/test_logprobs.py, patched into the actor).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os

MIB = 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith("VmHWM:")).split()[1]) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _variant(impl: str, seqs: int, seq_len: int, micro: int, temperature: float, mmap_kb: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0")
    os.environ.update(WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    import torch

    from rlstack.host_memory import set_mmap_threshold

    set_mmap_threshold(mmap_kb)  # as the trainer does (parallel.host_mmap_threshold_kb)

    from megatron_bridge import patches
    from megatron_bridge.hf import resolve_model_path
    from megatron_bridge.parallel import init_distributed
    from rlstack.config import AlgorithmConfig
    from rlstack.workers import actor as actor_mod
    from rlstack.workers.megatron_role import MegatronRole, OptimSettings

    if impl == "old":
        from tests.distributed.test_logprobs import reference_logprobs

        def old(logits, targets, vocab, group, rank, size, with_entropy=False, temperature=1.0):
            scaled = logits.float() / temperature if temperature != 1.0 else logits
            return reference_logprobs(scaled, targets, vocab, group, rank, size, with_entropy)

        actor_mod.vocab_parallel_logprobs = old
    row = {"impl": impl, "runtime": _rss() / MIB}
    patches.apply()
    groups = init_distributed(1, 1, backend="gloo")
    role = MegatronRole(
        resolve_model_path("default"),
        groups,
        torch.float32,
        optim=OptimSettings(lr=1e-6),
        fused_output=impl == "fused",
    )
    row["built"] = _rss() / MIB
    actor = actor_mod.Actor(role, AlgorithmConfig(use_kl_loss=False), temperature=temperature)
    mini = _batch(seqs, seq_len, role.args.vocab_size)
    counts = {"global_num_tokens": float(mini.resp_mask.sum()), "global_num_seqs": float(seqs)}
    actor.update(mini, counts, micro)
    row["after_step"] = _rss() / MIB
    _reset_peak()
    base = _rss()
    actor.update(mini, counts, micro)
    row["update_peak"] = _peak() / MIB
    row["update_extra"] = (_peak() - base) / MIB
    out.put(row)


def _batch(seqs: int, seq_len: int, vocab: int):
    import torch

    from rlstack.workers.batch import Rollout

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (seqs, seq_len), generator=gen)
    mask = torch.zeros(seqs, seq_len)
    mask[:, seq_len // 2 :] = 1.0
    lp = -torch.rand(seqs, seq_len, generator=gen) * mask
    return Rollout(
        tokens=tokens,
        position_ids=torch.arange(seq_len).expand(seqs, -1).contiguous(),
        resp_mask=mask,
        scores=torch.zeros(seqs),
        group_ids=torch.zeros(seqs, dtype=torch.long),
        rollout_logprob=lp,
        num_sequences=seqs,
        num_tokens=seqs * seq_len,
        on_policy=True,
        advantages=torch.randn(seqs, seq_len, generator=gen) * mask,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=100)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.5)
    ap.add_argument("--mmap-threshold-kb", type=int, default=256, help="glibc's mmap threshold (0: glibc's own)")
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    for impl in ("old", "new", "fused"):
        q = ctx.Queue()
        p = ctx.Process(target=_variant, args=(impl, a.seqs, a.seq_len, a.micro, a.temperature, a.mmap_threshold_kb, q))
        p.start()
        row = q.get()
        p.join()
        print(json.dumps({k: round(v) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
