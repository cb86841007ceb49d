"""Peak host memory of the log-prob/entropy computation, old (plain autograd) vs new (chunked function).

    PYTHONPATH=. .venv/bin/python benchmarks/logprob_memory.py [--tokens 3200] [--vocab 49152]

Each case runs in a fresh process: RSS after the logits exist is the baseline (the peak is reset
there), VmHWM at the end the peak; the figure is peak - baseline, i.e. what the log-prob maths adds on top of the
logits the model already produced (glibc returns these large blocks to the OS on free, so RSS
follows the live tensors). "update" is the actor's case (grad, entropy, backward with upstream
gradients); "score" the forward-only log-probs of the reference/old policy. The old function is
the oracle of tests/distributed/test_logprobs.py.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import time

MIB = 2**20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _case(impl: str, mode: str, tokens: int, vocab: int, temperature: float, out) -> None:
    import torch

    torch.manual_seed(0)
    logits = torch.randn(1, tokens, vocab) * 3
    targets = torch.randint(0, vocab, (1, tokens))
    logits.requires_grad_(mode == "update")
    _reset_peak()  # creating the inputs peaked above their own size (randn, then * 3)
    base = _rss_bytes()
    t0 = time.perf_counter()
    with torch.set_grad_enabled(mode == "update"):
        if impl == "old":
            from tests.distributed.test_logprobs import reference_logprobs

            x = logits / temperature if temperature != 1.0 else logits  # the old actor's fp32 copy
            res = reference_logprobs(x, targets, vocab, None, 0, 1, with_entropy=mode == "update")
        else:
            from rlstack.workers.logprobs import vocab_parallel_logprobs

            res = vocab_parallel_logprobs(
                logits, targets, vocab, None, 0, 1, with_entropy=mode == "update", temperature=temperature
            )
        if mode == "update":
            lp, ent = res
            (lp.sum() + 0.1 * ent.sum()).backward()
    seconds = time.perf_counter() - t0
    peak = _peak_bytes()
    out.put({"impl": impl, "mode": mode, "extra_mib": (peak - base) / MIB, "seconds": seconds})


def measure(tokens: int, vocab: int, temperature: float) -> list[dict]:
    ctx = mp.get_context("spawn")
    rows = []
    for mode in ("update", "score"):
        for impl in ("old", "new"):
            q = ctx.Queue()
            p = ctx.Process(target=_case, args=(impl, mode, tokens, vocab, temperature, q))
            p.start()
            rows.append(q.get())
            p.join()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=3200)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--temperature", type=float, default=0.5)
    a = ap.parse_args()
    logits_mib = a.tokens * a.vocab * 4 / MIB
    print(f"logits [{a.tokens}, {a.vocab}] fp32 = {logits_mib:.0f} MiB (not counted below)")
    for row in measure(a.tokens, a.vocab, a.temperature):
        row["x_logits"] = row["extra_mib"] / logits_mib
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
