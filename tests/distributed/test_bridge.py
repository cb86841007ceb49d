"""HF <-> Megatron bridge on CPU: logits equal to transformers at TP 1/2/4, PP 2, TP2 x PP2; bit-exact
round trips (in memory and through the convert CLI's dist checkpoint); errors that name the fix."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-4
# default tiny models: 4 heads in 2 query groups; TP 4 needs 4 query groups
WIDE = dict(num_attention_heads=8, num_key_value_heads=4, hidden_size=256)


def _tiny(cache, arch, **extra):
    from megatron_bridge.tiny import TinySpec, ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(TinySpec(arch=arch, tie_word_embeddings=arch == "llama", **extra), cache_dir=cache)


def _reference(hf_dir):
    from megatron_bridge.hf import read_model_args
    from megatron_bridge.verify import hf_logits, make_batch

    batch = make_batch(hf_dir, read_model_args(hf_dir).vocab_size, seq_len=24)
    return batch, hf_logits(hf_dir, batch)


def _sharded_copy(hf_dir, out_dir):
    """The same checkpoint written as several safetensors files with an index."""
    from safetensors.torch import load_file

    from megatron_bridge.hf import read_model_args, save_hf

    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    save_hf(state, read_model_args(hf_dir), out_dir, hf_dir, max_shard_bytes=200_000)
    assert os.path.isfile(os.path.join(out_dir, "model.safetensors.index.json"))
    return out_dir


def _logits_worker(cases, input_ids):
    """Each (hf_dir, tp, pp) in turn in one world of 4 ranks (DP fills the rest) -> logits per case."""
    from megatron.core import parallel_state as ps

    from megatron_bridge.hf import build_megatron_from_hf
    from megatron_bridge.parallel import init_distributed
    from megatron_bridge.verify import megatron_logits

    out = []
    for hf_dir, tp, pp in cases:
        groups = init_distributed(tp, pp)
        model, args = build_megatron_from_hf(hf_dir, groups)
        out.append(megatron_logits(model, input_ids, groups, args.vocab_size))
        ps.destroy_model_parallel()
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_equal_transformers_at_every_layout(arch, tiny_cache, tmp_path):
    from megatron_bridge.verify import max_abs_diff

    narrow, wide = _tiny(tiny_cache, arch), _tiny(tiny_cache, arch, **WIDE)
    sharded = _sharded_copy(narrow, str(tmp_path / "sharded"))
    cases = [(narrow, 1, 1), (narrow, 2, 1), (narrow, 1, 2), (sharded, 2, 2), (wide, 4, 1)]
    (batch, ref), (wide_batch, wide_ref) = _reference(narrow), _reference(wide)
    assert torch.equal(batch.input_ids, wide_batch.input_ids)
    per_rank = run_distributed(_logits_worker, 4, cases, batch.input_ids, timeout=240)
    for i, (hf_dir, tp, pp) in enumerate(cases):
        expected = wide_ref if hf_dir == wide else ref
        for rank_logits in per_rank:
            assert rank_logits[i].shape == expected.shape
            diff = max_abs_diff(rank_logits[i], expected, batch.lengths)
            assert diff < TOL, f"{arch} TP{tp} x PP{pp}: max |logit diff| {diff:.2e}"


def _round_trip_worker(hf_dir, out_dir, tp, pp):
    """-> (holds the state dict, elements this rank read from the checkpoint)."""
    from unittest import mock

    from megatron_bridge.hf import SafetensorsReader, build_megatron_from_hf, gather_hf_state_dict, save_hf
    from megatron_bridge.parallel import init_distributed

    groups = init_distributed(tp, pp)
    read, counted = SafetensorsReader.read, []

    def counting_read(*a):
        tensor = read(*a)
        counted.append(tensor.numel())
        return tensor

    with mock.patch.object(SafetensorsReader, "read", counting_read):
        model, args = build_megatron_from_hf(hf_dir, groups)
    state = gather_hf_state_dict(model, args, groups)
    if groups.rank == 0:
        save_hf(state, args, out_dir, hf_dir)
    return state is not None, sum(counted)


def _load(hf_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(hf_dir, "model.safetensors"))


def _assert_bit_exact(src_dir, out_dir):
    src, out = _load(src_dir), _load(out_dir)
    assert sorted(src) == sorted(out)
    for name in src:
        assert src[name].dtype == out[name].dtype and torch.equal(src[name], out[name]), name


def _assert_transformers_loads_cleanly(out_dir, src_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, info = AutoModelForCausalLM.from_pretrained(out_dir, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    text = "What is 12 plus 30?"
    assert (
        AutoTokenizer.from_pretrained(out_dir)(text)["input_ids"]
        == AutoTokenizer.from_pretrained(src_dir)(text)["input_ids"]
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_megatron_hf_round_trip_is_bit_exact(arch, tiny_cache, tmp_path):
    src, out = _tiny(tiny_cache, arch), str(tmp_path / "hf_out")
    flags, elements_read = zip(*run_distributed(_round_trip_worker, 4, src, out, 2, 2))
    assert flags == (True, False, False, False)  # only global rank 0 holds the state dict
    _assert_bit_exact(src, out)
    total = sum(t.numel() for t in _load(src).values())
    assert all(0 < n < 0.5 * total for n in elements_read), (elements_read, total)  # owned slices only
    _assert_transformers_loads_cleanly(out, src)


def _convert(*flags):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_bridge.convert", *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_convert_cli_round_trip_through_dist_checkpoint(tiny_cache, tmp_path):
    """Tied Llama at PP 2: the last stage's output layer copy goes through the dist checkpoint too."""
    src, mcore, out = _tiny(tiny_cache, "llama"), str(tmp_path / "mcore"), str(tmp_path / "hf")
    report = _convert("--hf-in", src, "--mcore-out", mcore, "--tp", "1", "--pp", "2")
    assert "rank 1:" in report and "peak_rss_mib" in report
    layout = json.load(open(os.path.join(mcore, "bridge_layout.json")))
    assert (layout["tp"], layout["pp"]) == (1, 2)
    _convert("--mcore-in", mcore, "--hf-out", out)  # layout read from the checkpoint
    _assert_bit_exact(src, out)
    _assert_transformers_loads_cleanly(out, src)


# ---------------------------------------------------------------- errors (no process group)


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    from megatron_bridge.hf import read_model_args

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="LlamaForCausalLM, Qwen2ForCausalLM"):
        read_model_args(str(tmp_path))


def test_missing_config_names_the_fix(tmp_path):
    from megatron_bridge.hf import resolve_model_path

    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def _edited_copy(src, dst, drop=(), config=None):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(os.path.join(src, "model.safetensors"))
    save_file({k: v for k, v in state.items() if k not in drop}, os.path.join(dst, "model.safetensors"))
    if config:
        cfg = json.load(open(os.path.join(src, "config.json")))
        json.dump({**cfg, **config}, open(os.path.join(dst, "config.json"), "w"))
    return dst


def test_missing_tensors_are_listed(tiny_qwen2, tmp_path):
    from megatron_bridge.hf import SafetensorsReader, check_hf_tensors, read_model_args

    drop = ("model.layers.1.self_attn.k_proj.bias", "model.norm.weight")
    broken = _edited_copy(tiny_qwen2, str(tmp_path / "broken"), drop=drop)
    with pytest.raises(ValueError, match="lacks 2 tensor.*model.layers.1.self_attn.k_proj.bias, model.norm.weight"):
        check_hf_tensors(SafetensorsReader(broken), read_model_args(broken))


def test_shape_mismatch_names_tensor_and_both_shapes(tiny_llama, tmp_path):
    from megatron_bridge.hf import SafetensorsReader, check_hf_tensors, read_model_args

    broken = _edited_copy(tiny_llama, str(tmp_path / "broken"), config={"intermediate_size": 512})
    with pytest.raises(
        ValueError,
        match=r"model.layers.0.mlp.gate_proj.weight: checkpoint \[256, 128\], "
        r"config.json implies \[512, 128\]",
    ):
        check_hf_tensors(SafetensorsReader(broken), read_model_args(broken))


def test_unused_tensors_are_rejected(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    from megatron_bridge.hf import SafetensorsReader, check_hf_tensors, read_model_args

    broken = _edited_copy(tiny_llama, str(tmp_path / "broken"))
    state = load_file(os.path.join(broken, "model.safetensors"))
    state["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(128)
    save_file(state, os.path.join(broken, "model.safetensors"))
    with pytest.raises(ValueError, match="does not use: model.layers.0.self_attn.o_proj.bias"):
        check_hf_tensors(SafetensorsReader(broken), read_model_args(broken))


@pytest.mark.parametrize(
    "tp, message",
    [(3, "does not divide the model's 4 attention heads"), (4, "does not divide the model's 2 key/value heads")],
)
def test_tp_must_divide_heads_and_query_groups(tiny_llama, tp, message):
    from megatron_bridge.hf import check_layout, read_model_args
    from megatron_bridge.parallel import ParallelDims

    with pytest.raises(ValueError, match=message):
        check_layout(read_model_args(tiny_llama), ParallelDims.resolve(tp, 1, 1, tp))


def test_sentencepiece_tokenizer_is_used_and_exported(tiny_llama, tmp_path):
    """A checkpoint whose tokenizer is a SentencePiece model (tokenizer.model, no tokenizer.json)."""
    import sentencepiece as spm
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from megatron_bridge.hf import read_model_args, save_hf
    from megatron_bridge.tiny import _corpus
    from megatron_bridge.verify import make_batch

    src = str(tmp_path / "spm")
    os.makedirs(src)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(os.path.join(tiny_llama, name), os.path.join(src, name))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(_corpus() * 3))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=os.path.join(src, "tokenizer"),
        vocab_size=120,
        model_type="bpe",
        hard_vocab_limit=False,
        minloglevel=2,
    )
    os.remove(os.path.join(src, "tokenizer.vocab"))
    json.dump({"tokenizer_class": "LlamaTokenizer"}, open(os.path.join(src, "tokenizer_config.json"), "w"))
    args = read_model_args(src)
    batch = make_batch(src, args.vocab_size, seq_len=16)
    assert batch.input_ids.shape[0] == 4 and int(batch.input_ids.max()) < 120
    out = save_hf(load_file(os.path.join(src, "model.safetensors")), args, str(tmp_path / "out"), src)
    assert os.path.isfile(os.path.join(out, "tokenizer.model"))
    text = "What is 12 plus 30?"
    assert (
        AutoTokenizer.from_pretrained(out)(text)["input_ids"] == AutoTokenizer.from_pretrained(src)(text)["input_ids"]
    )
