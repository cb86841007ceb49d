"""Out of memory and a full disk are resource errors (issue 34): one line naming what ran out, what
the plan needed and the setting to change; exit status 3; never "a bug in rlstack"."""

from __future__ import annotations

import errno

import pytest

from rlstack import errors
from rlstack.observability.logging import BUG_REPORT, user_error_guard


def _guard(exc, capsys):
    def fail():
        raise exc

    with pytest.raises(SystemExit) as e:
        user_error_guard(fail, rank=0)
    return e.value.code, capsys.readouterr().err


def test_host_out_of_memory_names_the_plan_and_the_settings(capsys, monkeypatch):
    monkeypatch.setitem(errors._plan, "line", "memory plan: peak 9.10 of 11.77 GiB host memory per rank (update): fits")
    code, err = _guard(MemoryError(), capsys)
    assert code == errors.RESOURCE_EXIT == 3
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: out of host memory (peak 9.10 of 11.77 GiB host memory per rank (update)")
    assert "algorithm.micro_batch_size" in line and BUG_REPORT not in err


def test_gpu_out_of_memory_is_named_as_gpu_memory(capsys):
    class OutOfMemoryError(RuntimeError):  # torch.OutOfMemoryError's name
        pass

    code, err = _guard(OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), capsys)
    assert code == 3 and err.strip().splitlines()[-1].startswith("error: out of GPU memory")


@pytest.mark.parametrize("number, words", [(errno.ENOSPC, "no space left"), (errno.EDQUOT, "disk quota exceeded")])
def test_a_full_disk_wrapped_in_another_error_names_the_file(capsys, number, words):
    try:
        try:
            raise OSError(number, "full", "/ckpt/step_00000003.tmp/actor/__0_0.distcp")
        except OSError as inner:
            raise RuntimeError("dist checkpointing failed") from inner
    except RuntimeError as outer:
        code, err = _guard(outer, capsys)
    line = err.strip().splitlines()[-1]
    assert code == 3 and words in line and "/ckpt/step_00000003.tmp/actor/__0_0.distcp" in line
    assert "checkpoint.dir" in line and BUG_REPORT not in err


def test_other_errors_stay_bugs(capsys):
    code, err = _guard(OSError(errno.EACCES, "denied"), capsys)
    assert code == 1 and BUG_REPORT in err
