"""Every translation the from_verl tests make is checked: when no key is UNSUPPORTED, the emitted
file must load and pass the config checks `--validate-only` runs (in-process, no model or data)."""

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
