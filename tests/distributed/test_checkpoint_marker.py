"""The completion marker describes its checkpoint: it lists every file but itself, and resume loads
nothing whose files differ from that list.

A marker written too early (before the ranks' shards) lists files that all exist with their sizes,
so checking each listed file alone lets it through; the loader then crashes, or loads a partial
checkpoint. Here: a real save on 2 gloo ranks (tiny Llama actor, DP2: each rank writes its own
shards) must produce a marker whose list is exactly the directory's files (shards, rank RNG files,
trainer state, config, HF side files), and a resume of a checkpoint holding a file its marker does
not list stops with one line naming the checkpoint and the fix (pure cases below, and
`Checkpointer.resume` itself on both ranks).
"""

from __future__ import annotations

import json
import os

import pytest

from rlstack.checkpoint import MARKER, CheckpointError, find_latest, verify_checkpoint, write_marker
from tests.dist_utils import run_distributed

REFUSAL = r"checkpoint {} holds files its completion marker COMPLETE\.json does not list \({}\).*resume from another"

# ----------------------------------------------------------------------------- pure: the rule


def _fake_checkpoint(root, step):
    path = os.path.join(root, f"step_{step:08d}")
    os.makedirs(os.path.join(path, "actor"))
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"step": step}, f)
    return path


def _add_shard(path, name="__0_0.distcp", size=100):
    with open(os.path.join(path, "actor", name), "wb") as f:
        f.write(b"x" * size)


def test_marker_written_before_the_shards_is_refused(tmp_path):
    path = _fake_checkpoint(str(tmp_path), 3)
    write_marker(path, 3)  # too early: every file it lists exists, at its size
    _add_shard(path)
    _add_shard(path, "__1_0.distcp")
    with pytest.raises(CheckpointError, match=REFUSAL.format(path, r"actor/__0_0\.distcp, actor/__1_0\.distcp")) as e:
        verify_checkpoint(path)
    assert "\n" not in str(e.value)  # one line


def test_marker_lists_every_file_but_itself(tmp_path):
    path = _fake_checkpoint(str(tmp_path), 3)
    _add_shard(path)
    marker = write_marker(path, 3)
    assert marker["files"] == {"trainer_state.json": len(json.dumps({"step": 3})), "actor/__0_0.distcp": 100}
    rewritten = write_marker(path, 3)  # a marker already there is not a file of the checkpoint
    assert rewritten["files"] == marker["files"]
    assert verify_checkpoint(path)["files"] == marker["files"]


def test_auto_skips_a_checkpoint_with_unlisted_files(tmp_path, caplog):
    root = str(tmp_path)
    good = _fake_checkpoint(root, 2)
    _add_shard(good)
    write_marker(good, 2)
    early = _fake_checkpoint(root, 3)
    write_marker(early, 3)
    _add_shard(early)
    with caplog.at_level("WARNING", logger="rlstack"):
        assert find_latest(root) == good
    assert f"checkpoint {early} holds files its completion marker" in caplog.text


# ----------------------------------------------------------------------------- distributed: a real save


def _config(out_dir, resume="never"):
    from rlstack.config import load_config

    overrides = ["data.synthetic=copy", "algorithm.name=grpo", f"trainer.output_dir={out_dir}"]
    return load_config(None, overrides + [f"checkpoint.resume={resume}"])


class _Step:
    def __init__(self, step):
        self.step = step

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def _save_then_resume_early_marker(hf_dir, out_dir):
    """Save (one Adam step first), then resume the same checkpoint after rank 0 dropped the shards
    from its marker -> the saved path, the marker's file list as saved, the resume error on this rank."""
    import torch

    from megatron_bridge.parallel import init_distributed
    from rlstack import collectives
    from rlstack.checkpoint import Checkpointer, CheckpointParts
    from rlstack.workers.megatron_role import MegatronRole, OptimSettings, split_micro_batches

    groups = init_distributed(1, 1, backend="gloo")  # DP2 on 2 ranks
    role = MegatronRole(hf_dir, groups, torch.float32, optim=OptimSettings(lr=1e-3))
    tokens = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(groups.dp_rank))
    batch = {"tokens": tokens, "position_ids": torch.arange(10).expand(2, 10).contiguous()}

    def loss_fn(mb, output):  # any smooth loss: one Adam step gives the optimizer state to save
        loss = output.float().square().mean()
        return loss, {"loss": loss.detach()}

    role.train_step(split_micro_batches(batch, 1), loss_fn)
    parts = CheckpointParts(roles={"actor": role}, states={"trainer": _Step(1)}, sources={"actor": hf_dir})
    path = Checkpointer(_config(out_dir), groups).save(parts)
    with open(os.path.join(path, MARKER)) as f:
        marker = json.load(f)
    saved = dict(marker["files"])
    collectives.barrier(groups.world, groups.device)
    if groups.rank == 0:  # the marker as a save that wrote it before the shards would leave it
        marker["files"] = {k: v for k, v in marker["files"].items() if not k.endswith(".distcp")}
        with open(os.path.join(path, MARKER), "w") as f:
            json.dump(marker, f)
    collectives.barrier(groups.world, groups.device)
    try:
        Checkpointer(_config(out_dir, resume=path), groups).resume(parts)
        error = None
    except CheckpointError as e:
        error = str(e)
    return {"path": path, "error": error, "saved": saved}


def _walk(path):
    out = {}
    for dirpath, _, names in os.walk(path):
        for name in names:
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, path)] = os.path.getsize(full)
    return out


def test_saved_marker_lists_every_file_and_resume_refuses_a_short_list(tiny_llama, tmp_path):
    results = run_distributed(_save_then_resume_early_marker, 2, tiny_llama, str(tmp_path), timeout=240)
    path = results[0]["path"]
    on_disk = _walk(path)
    on_disk.pop(MARKER)
    shards = [name for name in on_disk if name.startswith("actor/") and name.endswith(".distcp")]
    assert {os.path.basename(name).split("_")[2] for name in shards} == {"0", "1"}, (
        f"each rank writes its own shards: {shards}"
    )
    for name in ("rank_00000.pt", "rank_00001.pt", "trainer_state.json", "config.yaml"):
        assert name in on_disk
    assert any(name.startswith("hf_source/actor/") for name in on_disk)
    assert results[0]["saved"] == on_disk, "the marker as saved lists every file but itself, with its size"
    for r in results:  # both ranks stop with rank 0's one-line reason
        assert r["error"] is not None, "resume loaded a checkpoint whose marker lists no shards"
        assert r["error"].startswith(f"checkpoint {path} holds files its completion marker {MARKER} does not list")
        assert "\n" not in r["error"]
