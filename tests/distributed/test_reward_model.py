"""Reward models through the bridge: 1-label `*ForSequenceClassification` scores equal transformers'.

Tiny random Llama and Qwen2 sequence classifiers (num_labels=1, pad_token_id set) are built here;
the Megatron scalar head (from `score.weight`) is compared with transformers' own
`AutoModelForSequenceClassification` at TP1, TP2 and PP2, both at the pooled position and at every
real token. The export of a trained critic in the same format round-trips.
"""

import os
import subprocess
import sys

import pytest
import torch

from tests.dist_utils import free_port, run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-4
LAYOUTS = [(1, 1), (2, 1), (1, 2)]


def _tiny_rm(cache, arch):
    from megatron_bridge.tiny import TinySpec, ensure_tiny_reward_model

    return ensure_tiny_reward_model(TinySpec(arch=arch, tie_word_embeddings=arch == "llama", seed=3), cache_dir=cache)


def _scores_worker(hf_dir, input_ids):
    """Each layout in turn in one world of 2 ranks (DP fills the rest) -> the head's scores [B, S]."""
    from megatron.core import parallel_state as ps

    from megatron_bridge.hf import build_megatron_from_hf
    from megatron_bridge.parallel import init_distributed
    from megatron_bridge.verify import megatron_scores

    out = []
    for tp, pp in LAYOUTS:
        groups = init_distributed(tp, pp)
        model, _ = build_megatron_from_hf(hf_dir, groups, value_head=True)
        out.append(megatron_scores(model, input_ids, groups))
        ps.destroy_model_parallel()
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_reward_model_scores_equal_transformers(arch, tiny_cache):
    from megatron_bridge.hf import read_model_args
    from megatron_bridge.verify import hf_seq_cls_scores, make_batch, padding_mask

    hf_dir = _tiny_rm(tiny_cache, arch)
    batch = make_batch(hf_dir, read_model_args(hf_dir).vocab_size, seq_len=24)
    ref = hf_seq_cls_scores(hf_dir, batch)
    assert ref.pooled.std() > 0.1, "scores must differ between rows, or the comparison proves little"
    mask = padding_mask(batch).bool()
    per_rank = run_distributed(_scores_worker, 2, hf_dir, batch.input_ids, timeout=120)
    for i, (tp, pp) in enumerate(LAYOUTS):
        for scores in per_rank:
            pooled = scores[i].gather(1, ref.index[:, None])[:, 0]
            diff = (pooled - ref.pooled).abs().max().item()
            token_diff = (scores[i] - ref.per_token).abs()[mask].max().item()
            assert diff < TOL and token_diff < TOL, f"{arch} TP{tp} x PP{pp}: |score diff| {diff:.2e} {token_diff:.2e}"


def test_verify_cli_reward_model_at_tp2(tiny_cache):
    hf_dir = _tiny_rm(tiny_cache, "qwen2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    cmd += ["-m", "megatron_bridge.verify", "--hf", hf_dir, "--reward-model", "--tp", "2"]
    done = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    diffs = dict(line.split("=") for line in done.stdout.splitlines() if "score_diff=" in line)
    assert set(diffs) == {"max_abs_score_diff", "max_abs_token_score_diff"}
    assert all(float(v) < TOL for v in diffs.values()), diffs


def test_seq_cls_checkpoint_is_refused_as_a_language_model(tiny_cache):
    """A sequence classifier has no LM head: building it as an actor is a one-line user error."""
    from megatron_bridge.errors import InputError
    from megatron_bridge.hf import build_megatron_from_hf

    with pytest.raises(InputError, match="sequence-classification checkpoint.*reward_model.path"):
        build_megatron_from_hf(_tiny_rm(tiny_cache, "llama"), groups=None)  # refused before any group is used


def test_critic_exported_as_seq_cls_round_trips(tiny_llama, tmp_path):
    """A trained critic exported with --critic-format seq-cls: transformers' seq-cls scores equal the
    critic's values at the last non-pad token, and the bridge loads it back as a reward model."""
    from transformers import AutoModelForSequenceClassification

    from megatron_bridge.verify import hf_pool_index
    from tests.distributed.test_checkpoint import _train_save_forward

    path, tokens, _, values = run_distributed(_train_save_forward, 2, tiny_llama, str(tmp_path), timeout=240)[0]
    out = os.path.join(str(tmp_path), "hf")
    cmd = [sys.executable, "-m", "rlstack.export", "--ckpt", os.path.dirname(path), "--out", out]
    cmd += ["--critic", "--critic-format", "seq-cls"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rm, info = AutoModelForSequenceClassification.from_pretrained(out + "-critic", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    assert rm.config.num_labels == 1 and rm.config.architectures == ["LlamaForSequenceClassification"]
    with torch.no_grad():
        pooled = rm.eval()(tokens).logits[:, 0]  # [B]
    index = hf_pool_index(tokens, rm.config.pad_token_id)
    expected = values[..., 0].gather(1, index[:, None])[:, 0]
    assert (pooled - expected).abs().max() < TOL
    # and back through the bridge as a reward model (verify --reward-model at TP1)
    verify = [sys.executable, "-m", "megatron_bridge.verify", "--hf", out + "-critic", "--reward-model"]
    done = subprocess.run(verify, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
