"""Hub ids (`Qwen/Qwen3-0.6B`) resolved offline in the local Hugging Face cache; nothing is downloaded.

Clusters pre-fill the cache (`hf download ID` / `huggingface-cli download ID` on a machine with
network, then copy the cache directory over); a run names the model by its hub id and gets the
snapshot directory. The layout is huggingface_hub's (v0.x to 1.x, unchanged):

    $HF_HUB_CACHE/models--{org}--{name}/refs/{revision}    (a file holding the commit hash)
    $HF_HUB_CACHE/models--{org}--{name}/snapshots/{commit}/config.json, model.safetensors, ...

with HF_HUB_CACHE defaulting to $HF_HOME/hub, HF_HOME to $XDG_CACHE_HOME/huggingface (or
~/.cache/huggingface), as `huggingface_hub.constants` computes it. Read here directly (torch-free, no
huggingface_hub import: its constants are fixed at import time, and nothing here may reach the
network). `ID@REVISION` picks a branch, tag or commit; without one, `refs/main`, or the only
snapshot there is.
"""

from __future__ import annotations

import os
import re
from typing import Optional

from megatron_bridge.errors import InputError

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*(@[A-Za-z0-9_./-]+)?$")


def looks_like_hub_id(path: str) -> bool:
    """`org/name` or `org/name@revision` that is not a local path."""
    return bool(_HUB_ID.match(path)) and not os.path.exists(path) and not path.startswith((".", "~", "/"))


def hub_cache_dir(env: Optional[dict] = None) -> str:
    """Where huggingface_hub keeps models, from the same environment variables it reads."""
    env = os.environ if env is None else env
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return os.path.expanduser(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"])
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def resolve_hub_id(hub_id: str, cache_dir: Optional[str] = None) -> str:
    """The snapshot directory of `hub_id` in the local cache; InputError naming where it looked and
    how to fill it otherwise."""
    repo, _, revision = hub_id.partition("@")
    cache = cache_dir or hub_cache_dir()
    model_dir = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snapshots = os.path.join(model_dir, "snapshots")
    fill = (
        f"on a machine with network run `hf download {repo}` (or `huggingface-cli download {repo}`"
        f"{' --revision ' + revision if revision else ''}) and copy its cache to {cache} "
        "(HF_HOME / HF_HUB_CACHE point elsewhere), or pass a local checkpoint directory; "
        "rlstack never downloads models"
    )
    if not os.path.isdir(snapshots):
        raise InputError(f"model {hub_id} is not in the local Hugging Face cache (no {snapshots}): {fill}")
    commit = _commit(model_dir, snapshots, revision or "main")
    if commit is None:
        have = sorted(os.listdir(snapshots))
        raise InputError(
            f"model {hub_id}: the cache {model_dir} has no snapshot for revision {revision or 'main'!r} "
            f"(snapshots: {', '.join(have) or 'none'}): pass ID@COMMIT, or {fill}"
        )
    snapshot = os.path.join(snapshots, commit)
    if not os.path.isfile(os.path.join(snapshot, "config.json")):
        raise InputError(f"model {hub_id}: the cached snapshot {snapshot} has no config.json (incomplete): {fill}")
    return snapshot


def _commit(model_dir: str, snapshots: str, revision: str) -> Optional[str]:
    """The commit a revision names: refs/{revision}, a commit directory itself, or the only snapshot."""
    ref = os.path.join(model_dir, "refs", revision)
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            commit = f.read().strip()
        if os.path.isdir(os.path.join(snapshots, commit)):
            return commit
    if os.path.isdir(os.path.join(snapshots, revision)):
        return revision
    have = [d for d in os.listdir(snapshots) if os.path.isdir(os.path.join(snapshots, d))]
    if revision == "main" and len(have) == 1:  # filled without refs (copied snapshot only)
        return have[0]
    return None
