"""Checkpoints: marker/truncation rules (pure), and save -> resume on spawned gloo ranks.

Distributed cases build real MegatronRoles (actor + critic with value head, megatron optimizers) from
the tiny Llama, train them, save through `Checkpointer`, resume into freshly built roles and check:
weights, Adam state, step, sampler, KL controller and RNG streams come back exactly (the next
optimizer step gives bit-identical weights), each rank writes its own shards, and a checkpoint saved
at TP1 x DP2 loads at TP2 and at PP2 with every full tensor (weights and optimizer moments) unchanged.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from rlstack.checkpoint import (
    MARKER,
    CheckpointError,
    find_latest,
    list_checkpoints,
    resolve_resume,
    truncate_metrics,
    verify_checkpoint,
    write_marker,
)
from tests.dist_utils import run_distributed

# ----------------------------------------------------------------------------- pure: on-disk rules


def _fake_checkpoint(root, step, marker=True):
    path = os.path.join(root, f"step_{step:08d}")
    os.makedirs(os.path.join(path, "actor"))
    with open(os.path.join(path, "actor", "__0_0.distcp"), "wb") as f:
        f.write(b"x" * 100)
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"step": step}, f)
    if marker:
        write_marker(path, step)
    return path


def test_complete_checkpoint_verifies(tmp_path):
    path = _fake_checkpoint(str(tmp_path), 3)
    marker = verify_checkpoint(path)
    assert marker["step"] == 3
    assert marker["files"]["actor/__0_0.distcp"] == 100


def test_markerless_checkpoint_is_refused(tmp_path):
    path = _fake_checkpoint(str(tmp_path), 3, marker=False)
    with pytest.raises(CheckpointError, match=r"step_00000003 has no completion marker COMPLETE\.json"):
        verify_checkpoint(path)


def test_truncated_checkpoint_is_refused(tmp_path):
    path = _fake_checkpoint(str(tmp_path), 3)
    with open(os.path.join(path, "actor", "__0_0.distcp"), "r+b") as f:
        f.truncate(40)
    with pytest.raises(
        CheckpointError,
        match=r"is truncated: actor/__0_0.distcp has 40 bytes, the completion "
        r"marker records 100",
    ):
        verify_checkpoint(path)


def test_missing_file_and_torn_marker_are_refused(tmp_path):
    path = _fake_checkpoint(str(tmp_path), 3)
    os.remove(os.path.join(path, "trainer_state.json"))
    with pytest.raises(CheckpointError, match="trainer_state.json is missing"):
        verify_checkpoint(path)
    with open(os.path.join(path, MARKER), "r+") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match="unreadable completion marker"):
        verify_checkpoint(path)


def test_auto_falls_back_to_previous_complete_and_says_so(tmp_path, caplog):
    root = str(tmp_path)
    _fake_checkpoint(root, 2)
    good = _fake_checkpoint(root, 3)
    _fake_checkpoint(root, 4, marker=False)
    broken = _fake_checkpoint(root, 5)
    with open(os.path.join(broken, "actor", "__0_0.distcp"), "r+b") as f:
        f.truncate(1)
    os.makedirs(os.path.join(root, "step_00000006.tmp"))  # an interrupted save: never a candidate
    assert [s for s, _ in list_checkpoints(root)] == [5, 4, 3, 2]
    with caplog.at_level("WARNING", logger="rlstack"):
        assert find_latest(root) == good
    text = caplog.text
    assert "step_00000005 is truncated" in text and "step_00000004 has no completion marker" in text
    assert f"falls back to {good}" in text


def test_auto_with_no_complete_checkpoint_raises(tmp_path):
    root = str(tmp_path)
    _fake_checkpoint(root, 4, marker=False)
    with pytest.raises(CheckpointError, match="no complete checkpoint in .*checkpoint.resume=never"):
        find_latest(root)
    assert find_latest(os.path.join(root, "nothing_here")) is None


def test_resolve_resume_modes(tmp_path):
    from rlstack.config import load_config

    root = os.path.join(str(tmp_path), "checkpoints")
    os.makedirs(root)
    old = _fake_checkpoint(root, 1)
    new = _fake_checkpoint(root, 2)
    base = ["data.synthetic=copy", f"trainer.output_dir={tmp_path}"]
    assert resolve_resume(load_config(None, base + ["checkpoint.resume=never"])) is None
    assert resolve_resume(load_config(None, base + ["checkpoint.resume=auto"])) == new
    assert resolve_resume(load_config(None, base + [f"checkpoint.resume={old}"])) == old
    assert resolve_resume(load_config(None, base + [f"checkpoint.resume={root}"])) == new
    os.remove(os.path.join(old, MARKER))
    with pytest.raises(CheckpointError, match="step_00000001 has no completion marker"):
        resolve_resume(load_config(None, base + [f"checkpoint.resume={old}"]))
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve_resume(load_config(None, base + [f"checkpoint.resume={tmp_path}/missing"]))


def test_truncate_metrics_keeps_steps_up_to_resume(tmp_path):
    path = os.path.join(str(tmp_path), "metrics.jsonl")
    with open(path, "w") as f:
        for step in (0, 1, 2, 3, 4):
            f.write(json.dumps({"step": step, "reward/mean": step / 10}) + "\n")
        f.write('{"step": 5, "rew')  # torn by a kill
    appender = open(path, "a")  # the run's JsonlTracker holds the file open for append
    assert truncate_metrics(path, 3) == 2  # step 4 and the torn line
    appender.write(json.dumps({"step": 4, "reward/mean": 9.0}) + "\n")
    appender.close()
    with open(path) as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == [0, 1, 2, 3, 4]


# ----------------------------------------------------------------------------- distributed helpers


def _config(out_dir, **ckpt):
    from rlstack.config import load_config

    overrides = ["data.synthetic=copy", "algorithm.name=ppo", f"trainer.output_dir={out_dir}"]
    overrides += [f"checkpoint.{k}={v}" for k, v in ckpt.items()]
    return load_config(None, overrides)


class _Fake:
    """The parts of a trainer that a checkpoint holds; `parts()` hands them over as the trainer does."""

    def __init__(self, actor, critic, sampler, kl_ctrl, hf_dir):
        self.actor, self.critic = SimpleNamespace(role=actor), SimpleNamespace(role=critic)
        self.sampler, self.kl_ctrl, self.hf_dir, self.step = sampler, kl_ctrl, hf_dir, 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]

    def parts(self):
        from rlstack.checkpoint import CheckpointParts

        return CheckpointParts(
            roles={"actor": self.actor.role, "critic": self.critic.role},
            states={"trainer": self, "sampler": self.sampler, "kl_ctrl": self.kl_ctrl},
            sources={"actor": self.hf_dir, "critic": self.hf_dir},
        )


def _trainer(hf_dir, groups, dist_opt=False, seed=0):
    import torch

    from rlstack.algorithms import build_kl_controller
    from rlstack.data.sampler import PromptSampler
    from rlstack.workers.megatron_role import MegatronRole, OptimSettings

    optim = OptimSettings(lr=1e-2, use_distributed_optimizer=dist_opt)
    actor = MegatronRole(hf_dir, groups, torch.float32, optim=optim)
    critic = MegatronRole(hf_dir, groups, torch.float32, value_head=True, optim=optim, value_head_seed=seed)
    return _Fake(
        actor,
        critic,
        PromptSampler(64, 8, seed=0, dp_rank=groups.dp_rank, dp_size=groups.dims.dp),
        build_kl_controller("adaptive", 0.05, 0.1, 100),
        hf_dir,
    )


def _train_step(trainer, groups):
    """One optimizer step of both roles on data that depends on the step and the DP rank."""
    import torch

    from rlstack.workers.megatron_role import split_micro_batches

    gen = torch.Generator().manual_seed(1000 * trainer.step + groups.dp_rank)
    tokens = torch.randint(0, 300, (4, 12), generator=gen)
    batch = {"tokens": tokens, "position_ids": torch.arange(12).expand(4, 12).contiguous()}

    def loss_fn(mb, output):  # any smooth function of the output gives Adam something to remember
        loss = output.float().square().mean()
        return loss, {"loss": loss.detach()}

    for role in (trainer.actor.role, trainer.critic.role):
        role.train_step(split_micro_batches(batch, 2), loss_fn)
    trainer.sampler.next_batch()
    trainer.kl_ctrl.update(0.3, n_steps=8)
    trainer.step += 1


def _local_state(trainer):
    """Every local parameter, optimizer main parameter and Adam tensor of both roles, cloned."""
    out = {}
    for name, role in (("actor", trainer.actor.role), ("critic", trainer.critic.role)):
        for pname, p in role.module.named_parameters():
            out[f"{name}.{pname}"] = p.detach().clone()
        inner = getattr(role.optimizer, "chained_optimizers", None) or [role.optimizer]
        for j, torch_opt in enumerate(o.optimizer for o in inner):
            for gi, group in enumerate(torch_opt.param_groups):
                for pi, p in enumerate(group["params"]):  # main params: fp32 DP shards with dist-opt
                    out[f"{name}.opt{j}.{gi}.{pi}.main"] = p.detach().clone()
                    for key, value in torch_opt.state[p].items():
                        out[f"{name}.opt{j}.{gi}.{pi}.{key}"] = value.detach().clone()
    return out


def _assert_same(a, b, what):
    import torch

    assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b)))
    for key in a:
        if torch.is_tensor(a[key]):
            assert torch.equal(a[key], b[key]), f"{what}: {key} differs"
        else:
            assert a[key] == b[key], f"{what}: {key} differs ({a[key]} vs {b[key]})"


# ----------------------------------------------------------------------------- distributed: exact resume


def _save_then_resume(hf_dir, out_dir, tp, dist_opt):
    import random

    import torch

    from megatron_bridge.parallel import init_distributed
    from rlstack.checkpoint import Checkpointer

    groups = init_distributed(tp, 1, backend="gloo")
    cfg = _config(out_dir, save_every=2, keep_last=1)
    trainer = _trainer(hf_dir, groups, dist_opt)
    ckpt = Checkpointer(cfg, groups)
    for _ in range(2):
        _train_step(trainer, groups)
        ckpt.maybe_save(trainer.parts())
    saved = _local_state(trainer)
    draws = (torch.rand(3), random.random())  # RNG streams right after the save
    sampler_state, kl_value = trainer.sampler.state_dict(), trainer.kl_ctrl.value
    _train_step(trainer, groups)
    after_next = _local_state(trainer)

    torch.manual_seed(1234)
    random.seed(1234)
    fresh = _trainer(hf_dir, groups, dist_opt, seed=99)
    assert Checkpointer(cfg, groups).resume(fresh.parts()) == 2
    _assert_same(_local_state(fresh), saved, "resumed state")
    assert torch.equal(torch.rand(3), draws[0]) and random.random() == draws[1]
    assert fresh.sampler.state_dict() == sampler_state and fresh.kl_ctrl.value == kl_value
    _train_step(fresh, groups)
    _assert_same(_local_state(fresh), after_next, "one step after resume")
    root = os.path.join(out_dir, "checkpoints")
    return sorted(os.listdir(root)), sorted(os.listdir(os.path.join(root, "step_00000002", "actor")))


@pytest.mark.parametrize("tp,dist_opt", [(1, True), (2, False)], ids=["tp1dp2-distopt", "tp2"])
def test_resume_is_exact(tiny_llama, tmp_path, tp, dist_opt):
    results = run_distributed(_save_then_resume, 2, tiny_llama, str(tmp_path), tp, dist_opt, timeout=240)
    published, actor_files = results[0]
    assert published == ["latest", "step_00000002"]
    with open(os.path.join(tmp_path, "checkpoints", "latest")) as f:
        assert f.read().strip() == "step_00000002"
    writers = {name.split("_")[2] for name in actor_files if name.endswith(".distcp")}
    assert writers == {"0", "1"}, f"each rank writes its own shards: {actor_files}"


# ----------------------------------------------------------------------------- distributed: reshard on load


def _save_tp1(hf_dir, out_dir):
    from megatron_bridge.parallel import init_distributed
    from rlstack.checkpoint import Checkpointer

    groups = init_distributed(1, 1, backend="gloo")
    trainer = _trainer(hf_dir, groups)
    for _ in range(2):
        _train_step(trainer, groups)
    return Checkpointer(_config(out_dir), groups).save(trainer.parts())


def _resume_resave_compare(hf_dir, saved, out_dir, tp, pp):
    """Resume `saved` at TP x PP, save again, and return the keys whose full tensors differ."""
    from megatron_bridge.parallel import init_distributed
    from rlstack.checkpoint import Checkpointer

    groups = init_distributed(tp, pp, backend="gloo")
    trainer = _trainer(hf_dir, groups, seed=7)
    assert Checkpointer(_config(out_dir, resume=saved), groups).resume(trainer.parts()) == 2
    trainer.step = 20
    resaved = Checkpointer(_config(out_dir), groups).save(trainer.parts())
    before, after = _plain_tensors(saved), _plain_tensors(resaved)
    assert before.keys() == after.keys(), sorted(set(before) ^ set(after))
    assert any("exp_avg_sq" in k for k in before) and any("critic/output_layer" in k for k in before)
    return [key for key in before if not _same_up_to_vocab_padding(before[key], after[key])]


def _plain_tensors(path):
    """Every full tensor of a checkpoint's roles, whatever layout saved it (collective)."""
    from megatron.core import dist_checkpointing

    out = {}
    for role in ("actor", "critic"):
        loaded = dist_checkpointing.load_plain_tensors(os.path.join(path, role))
        out.update(_flatten(loaded, role))
    return out


def _flatten(tree, prefix):
    if isinstance(tree, (list, tuple)):
        tree = dict(enumerate(tree))
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for k, v in tree.items():
        out.update(_flatten(v, f"{prefix}/{k}"))
    return out


def _same_up_to_vocab_padding(old, new) -> bool:
    """Equal, except that vocab padding rows (zeros) grow with TP: 384 rows at TP1, 512 at TP2."""
    import torch

    if not torch.is_tensor(old):
        return old == new
    if old.shape != new.shape:
        rows = min(old.shape[0], new.shape[0])
        if old[rows:].any() or new[rows:].any():
            return False
        old, new = old[:rows], new[:rows]
    return torch.equal(old, new)


@pytest.fixture(scope="module")
def tp1_checkpoint(tiny_llama, tmp_path_factory):
    """Actor + critic (with Adam state) trained 2 steps at TP1 x DP2 and saved."""
    out = str(tmp_path_factory.mktemp("tp1_run"))
    return run_distributed(_save_tp1, 2, tiny_llama, out, timeout=240)[0]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["to-tp2", "to-pp2"])
def test_tp1_checkpoint_loads_at_new_layout(tiny_llama, tp1_checkpoint, tmp_path, tp, pp):
    differ = run_distributed(_resume_resave_compare, 2, tiny_llama, tp1_checkpoint, str(tmp_path), tp, pp, timeout=240)[
        0
    ]
    assert differ == [], f"tensors changed by the reshard: {differ}"


# ----------------------------------------------------------------------------- export through the bridge


def _train_save_forward(hf_dir, out_dir):
    """At TP2: train 2 steps, save, and return the actor's logits and the critic's values on a batch."""
    import torch
    import torch.distributed as dist

    from megatron_bridge.parallel import init_distributed
    from rlstack.checkpoint import Checkpointer

    groups = init_distributed(2, 1, backend="gloo")
    trainer = _trainer(hf_dir, groups)
    for _ in range(2):
        _train_step(trainer, groups)
    path = Checkpointer(_config(out_dir), groups).save(trainer.parts())
    tokens = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(10).expand(2, 10).contiguous()
    with torch.no_grad():
        shard = trainer.actor.role.module(tokens, positions, None)  # [B, S, padded_vocab / tp]
        values = trainer.critic.role.module(tokens, positions, None)  # [B, S, 1]
    shards = [torch.empty_like(shard) for _ in range(groups.dims.tp)]
    dist.all_gather(shards, shard.contiguous(), group=groups.tp)
    logits = torch.cat(shards, dim=-1)[..., : trainer.actor.role.args.vocab_size]
    return path, tokens, logits, values


def test_export_matches_trained_models(tiny_llama, tmp_path):
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    path, tokens, logits, values = run_distributed(_train_save_forward, 2, tiny_llama, str(tmp_path), timeout=240)[0]
    out = os.path.join(str(tmp_path), "hf_actor")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "rlstack.export", "--ckpt", os.path.dirname(path), "--out", out, "--critic"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"actor: {out}" in done.stdout and f"critic: {out}-critic" in done.stdout

    actor, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    critic, info = AutoModelForTokenClassification.from_pretrained(out + "-critic", output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        hf_logits = actor.eval()(tokens).logits  # [B, S, V]
        hf_values = critic.eval()(tokens).logits  # [B, S, 1]
    assert (hf_logits - logits).abs().max() < 1e-4
    assert (hf_values - values).abs().max() < 1e-4
    assert (logits - AutoModelForCausalLM.from_pretrained(tiny_llama)(tokens).logits).abs().max() > 1e-3, (
        "training changed the actor, so the comparison is not against the starting weights"
    )
