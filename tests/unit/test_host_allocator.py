"""parallel.host_allocator: which allocator a rank wants, the re-exec that preloads tcmalloc, the errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlstack.config import ConfigError, load_config
from rlstack.errors import UserError
from rlstack.host_memory import TCMALLOC_ENV, find_tcmalloc, wanted_allocator

needs_tcmalloc = pytest.mark.skipif(find_tcmalloc() is None, reason="libtcmalloc is not installed here")

# A stand-in rank: asks for an allocator, then says which one it runs on and how often it started.
PROBE = """
import os, sys
from rlstack.host_memory import exec_with_allocator, loaded_allocator
print("start", flush=True)
exec_with_allocator(sys.argv[1])
print(loaded_allocator(), os.environ.get("RLSTACK_HOST_ALLOCATOR_EXEC", "-"), sys.argv[1:])
print("release rate", os.environ.get("TCMALLOC_RELEASE_RATE", "-"))
from rlstack.host_memory import trim_heap
print("trim", trim_heap())
"""


def _probe(choice: str, env=None) -> list[str]:
    import os

    env = {**os.environ, **(env or {})}
    env.pop("LD_PRELOAD", None)
    env.pop("TCMALLOC_RELEASE_RATE", None)
    out = subprocess.run([sys.executable, "-c", PROBE, choice, "x=1"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\n")


def test_glibc_is_kept_and_unknown_names_are_config_errors():
    assert wanted_allocator("glibc") == ("glibc", None)
    with pytest.raises(UserError, match="host_allocator='jemalloc'"):
        wanted_allocator("jemalloc")
    with pytest.raises(ConfigError, match="host_allocator"):
        load_config(None, ["parallel.host_allocator=jemalloc"])


def test_tcmalloc_asked_for_and_missing_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv(TCMALLOC_ENV, str(tmp_path / "nope.so"))
    with pytest.raises(UserError, match="parallel.host_allocator=tcmalloc.*libtcmalloc-minimal4.*host_allocator=glibc"):
        wanted_allocator("tcmalloc")
    assert wanted_allocator("auto") == ("glibc", None)  # auto falls back quietly


def test_validate_only_reports_a_missing_tcmalloc_in_one_line(tmp_path):
    import os

    env = {**os.environ, TCMALLOC_ENV: str(tmp_path / "nope.so")}
    cmd = [sys.executable, "-m", "rlstack.train", "--config", "yaml_configs/tiny_cpu.yaml", "--validate-only"]
    out = subprocess.run([*cmd, "parallel.host_allocator=tcmalloc"], capture_output=True, text=True, env=env)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: parallel.host_allocator=tcmalloc"), out.stderr


@needs_tcmalloc
def test_auto_takes_tcmalloc_on_cpu_hosts_only():
    assert wanted_allocator("auto", gpu_host=False)[0] == "tcmalloc"
    assert wanted_allocator("auto", gpu_host=True) == ("glibc", None)
    assert wanted_allocator("tcmalloc", gpu_host=True)[0] == "tcmalloc"  # asked for by name: always


@needs_tcmalloc
def test_the_rank_reexecutes_once_onto_tcmalloc_with_its_arguments():
    lines = _probe("tcmalloc")
    # "start" twice: the first process replaced itself; then tcmalloc is mapped, arguments kept,
    # and its background release is off (freed spans stay for reuse: host_memory.trim_heap).
    want = ["start", "start", "tcmalloc 1 ['tcmalloc', 'x=1']", "release rate 0", "trim False"]
    assert lines[:5] == want, lines


def test_glibc_does_not_reexecute():
    lines = _probe("glibc")
    assert lines[:3] == ["start", "glibc - ['glibc', 'x=1']", "release rate -"], lines
    assert lines[3] in ("trim True", "trim False")  # malloc_trim: whether this small process had pages to give


@needs_tcmalloc
def test_a_preload_that_does_not_take_is_not_retried(tmp_path):
    # The mark says the exec already happened: no loop, the process goes on with glibc.
    lines = _probe("tcmalloc", {"RLSTACK_HOST_ALLOCATOR_EXEC": "1"})
    assert lines[:2] == ["start", "glibc 1 ['tcmalloc', 'x=1']"], lines
