"""Every translation the from_verl tests make is checked: when no key is UNSUPPORTED, the emitted
file must load and pass the config checks `--validate-only` runs (in-process, no model or data).
`world_of_one`: a one-rank gloo process group for unit tests of code that calls collectives.
`model_dir` / `tok`: the tiny tied Llama checkpoint and its tokenizer (a module may define its own)."""

import pytest


def validate_translation(t, directory) -> None:
    """The emitted YAML loads (typed tree, value checks) and its layout resolves on t.world_size ranks."""
    from rlstack import from_verl
    from rlstack.config import load_config
    from rlstack.parallel import check_layout

    path = directory / f"from_verl_{id(t)}.yaml"
    path.write_text(from_verl.to_yaml_text(t))
    cfg = load_config(str(path))
    check_layout(cfg, t.world_size)


@pytest.fixture(autouse=True)
def _validate_from_verl_translations(request):
    if "from_verl" not in request.module.__name__:
        yield
        return
    from rlstack import from_verl

    monkeypatch, tmp_path = request.getfixturevalue("monkeypatch"), request.getfixturevalue("tmp_path")

    made = []
    translate = from_verl.translate

    def recording(verl):
        t = translate(verl)
        made.append(t)
        return t

    monkeypatch.setattr(from_verl, "translate", recording)
    yield made
    for t in made:
        if not t.unsupported:
            validate_translation(t, tmp_path)


@pytest.fixture
def world_of_one(monkeypatch):
    """A one-rank gloo process group (torch.distributed's WORLD), destroyed after the test."""
    import torch.distributed as dist

    from tests.dist_utils import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    dist.init_process_group("gloo", world_size=1, rank=0)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tiny_cache):
    from megatron_bridge.tiny import TinySpec, ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(TinySpec(arch="llama", tie_word_embeddings=True), cache_dir=tiny_cache)


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
