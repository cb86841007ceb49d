"""`model.path` as a hub id resolves offline to a snapshot in the local HF cache (huggingface_hub's
layout: refs/main -> snapshots/<commit>/ with files symlinked into blobs/); nothing is downloaded, and
a missing snapshot names the directory looked in and how to fill it."""

from __future__ import annotations

import os
import shutil

import pytest

from megatron_bridge.errors import InputError
from megatron_bridge.hub_cache import hub_cache_dir, looks_like_hub_id, resolve_hub_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _fill_cache(cache, src_dir, repo="org/tiny-qwen3", commit=COMMIT, ref="main"):
    """What `hf download` leaves: blobs, a snapshot of symlinks to them, refs/main."""
    model_dir = os.path.join(cache, "models--" + repo.replace("/", "--"))
    blobs, snapshot = os.path.join(model_dir, "blobs"), os.path.join(model_dir, "snapshots", commit)
    os.makedirs(blobs, exist_ok=True)
    os.makedirs(snapshot)
    for i, name in enumerate(sorted(os.listdir(src_dir))):
        blob = os.path.join(blobs, f"blob{commit[:4]}{i}")
        shutil.copyfile(os.path.join(src_dir, name), blob)
        os.symlink(os.path.relpath(blob, snapshot), os.path.join(snapshot, name))
    if ref:
        os.makedirs(os.path.join(model_dir, "refs"), exist_ok=True)
        with open(os.path.join(model_dir, "refs", ref), "w") as f:
            f.write(commit)
    return snapshot


@pytest.fixture
def tiny_qwen3(tiny_cache):
    from megatron_bridge.tiny import TinySpec, ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(TinySpec(arch="qwen3", head_dim=64, tie_word_embeddings=False), cache_dir=tiny_cache)


def test_cache_dir_follows_huggingface_hub_variables(tmp_path):
    assert hub_cache_dir({"HF_HUB_CACHE": "/x/hub", "HF_HOME": "/y"}) == "/x/hub"
    assert hub_cache_dir({"HF_HOME": "/y"}) == "/y/hub"
    assert hub_cache_dir({"XDG_CACHE_HOME": "/z"}) == "/z/huggingface/hub"
    assert hub_cache_dir({}) == os.path.expanduser("~/.cache/huggingface/hub")


def test_hub_id_resolves_to_the_cached_snapshot(tmp_path, monkeypatch, tiny_qwen3):
    from megatron_bridge.hf import read_model_args, resolve_model_path
    from rlstack.preflight import check_model_dir

    snapshot = _fill_cache(str(tmp_path / "home" / "hub"), tiny_qwen3)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert looks_like_hub_id("org/tiny-qwen3") and not looks_like_hub_id(tiny_qwen3)
    assert resolve_model_path("org/tiny-qwen3") == snapshot
    assert resolve_model_path(f"org/tiny-qwen3@{COMMIT}") == snapshot
    assert read_model_args(resolve_model_path("org/tiny-qwen3")).arch == "qwen3"
    check_model_dir("org/tiny-qwen3", "model.path")  # preflight accepts it: config, tokenizer, weights


def test_preflight_checks_the_layout_of_a_cached_hub_id(tmp_path, monkeypatch, tiny_qwen3):
    from rlstack.config import load_config
    from rlstack.preflight import preflight

    _fill_cache(str(tmp_path / "hub"), tiny_qwen3)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    tiny_yaml = os.path.join(os.path.dirname(__file__), "..", "..", "yaml_configs", "tiny_cpu.yaml")
    out = f"trainer.output_dir={tmp_path / 'out'}"
    assert preflight(load_config(tiny_yaml, ["model.path=org/tiny-qwen3", out]), world_size=2).dims.dp == 2
    with pytest.raises(InputError, match="4 attention heads"):  # the snapshot's config.json reached the checks
        preflight(load_config(tiny_yaml, ["model.path=org/tiny-qwen3", "parallel.tp=3", out]), world_size=3)


def test_copied_snapshot_without_refs_and_revisions(tmp_path, monkeypatch, tiny_qwen3):
    cache = str(tmp_path / "hub")
    only = _fill_cache(cache, tiny_qwen3, ref=None)
    assert resolve_hub_id("org/tiny-qwen3", cache) == only  # the one snapshot there is
    other = "f" * 40
    _fill_cache(cache, tiny_qwen3, commit=other, ref="v2")
    with pytest.raises(InputError, match=f"no snapshot for revision 'main'.*{COMMIT}, {other}"):
        resolve_hub_id("org/tiny-qwen3", cache)  # two snapshots, no refs/main: ambiguous
    assert resolve_hub_id("org/tiny-qwen3@v2", cache).endswith(other)


def test_missing_snapshot_names_the_directory_and_the_download(tmp_path, monkeypatch):
    from rlstack.errors import UserError
    from rlstack.preflight import check_model_dir

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    looked = os.path.join(str(tmp_path / "hub"), "models--Qwen--Qwen3-0.6B", "snapshots")
    with pytest.raises(UserError, match="model.path: model Qwen/Qwen3-0.6B is not in the local") as e:
        check_model_dir("Qwen/Qwen3-0.6B", "model.path")
    message = str(e.value)
    assert looked in message and "huggingface-cli download Qwen/Qwen3-0.6B" in message
    assert "never downloads" in message and "\n" not in message
