"""What the fused log-prob + entropy costs beyond its matmuls, against the byte floor of its logits.

    PYTHONPATH=. .venv/bin/python -m benchmarks.vocab_passes [--rows 216] [--threads 1]

One micro-batch of the actor's update (SmolLM2: 8 sequences x ~27 scored response positions = 216
rows, hidden 576, vocabulary 49152, fp32, temperature 0.5, entropy on, as the bench config runs):
- `fused_output_logprobs` forward + backward (rlstack/workers/logprobs.py), the update's path;
- its four matmuls alone (logits in forward, logits again in backward, the hidden states' and the
  weight's gradients), the part the FLOP floor counts;
- the rest (exp, max, sums, the softmax and entropy gradient: elementwise over [rows, vocab] fp32)
  against the byte model's floor for these logits (benchmarks/bytes.py: 6 x rows x vocab x 4 bytes)
  at the machine's read rate (benchmarks/ceilings.py `read_rate`).
docs/benchmarks.md ("Byte floor") has the figures.
"""

from __future__ import annotations

import argparse
import json
import time


def _fastest_s(fns, reps: int) -> list[float]:
    """Each function's fastest of `reps` calls, the functions interleaved (a shared machine only ever
    slows a call down, and interleaving exposes them to the same load)."""
    for fn in fns:
        fn()  # warm-up: buffers, kernel selection
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def measure(rows: int, hidden: int, vocab: int, reps: int, temperature: float = 0.5) -> dict:
    import torch

    from benchmarks.bytes import LOGIT_BYTES
    from benchmarks.ceilings import read_rate
    from rlstack.workers.logprobs import FUSED_CHUNK_ELEMS, fused_output_logprobs

    torch.manual_seed(0)
    h = (torch.randn(rows, hidden) * 0.5).requires_grad_(True)
    w = (torch.randn(vocab, hidden) * 0.05).requires_grad_(True)
    targets = torch.randint(0, vocab, (rows,))
    main_grad = torch.zeros(vocab, hidden)  # megatron's grad buffer, as the trainer passes it (no new zeros)

    def fused():
        lp, ent = fused_output_logprobs(
            h, w, targets, vocab, None, 0, 1, with_entropy=True, temperature=temperature, main_grad=main_grad
        )
        (lp.sum() + 0.01 * ent.sum()).backward()
        h.grad = None

    hd, wd = h.detach(), w.detach()
    chunk = max(1, FUSED_CHUNK_ELEMS // vocab)  # the fused function's rows per chunk
    logits = torch.empty(min(chunk, rows), vocab)
    grad_h = torch.empty(rows, hidden)

    def matmuls():  # the same chunks, the same four matmuls
        for lo in range(0, rows, chunk):
            hi = min(rows, lo + chunk)
            x = logits[: hi - lo]
            torch.mm(hd[lo:hi], wd.t(), out=x)  # forward
            torch.mm(hd[lo:hi], wd.t(), out=x)  # backward recomputes the chunk's logits
            grad_h[lo:hi] = x @ wd
            main_grad.addmm_(x.t(), hd[lo:hi])

    fused_s, matmul_s = _fastest_s([fused, matmuls], reps)
    floor_bytes = 6 * rows * vocab * LOGIT_BYTES
    read = read_rate(256 * 2**20, torch.device("cpu"))
    return {
        "rows": rows,
        "hidden": hidden,
        "vocab": vocab,
        "threads": torch.get_num_threads(),
        "fused_s": fused_s,
        "matmuls_s": matmul_s,
        "elementwise_s": fused_s - matmul_s,
        "logit_floor_bytes": floor_bytes,
        "read_bytes_per_s": read,
        "logit_floor_s": floor_bytes / read,
        "elementwise_over_logit_floor": (fused_s - matmul_s) / (floor_bytes / read),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=216)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    print(json.dumps(measure(args.rows, args.hidden, args.vocab, args.reps), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
