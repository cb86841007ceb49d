"""Nothing a user saved is lost (issue 32), the checks that need no training run: the run lock under
races and stale holders, the overwrite set-aside, pruning, exits from user code, duplicate config
keys, unusable paths, and every check --validate-only must share with the run."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys

import pytest

from rlstack import run_dir
from rlstack.config import ConfigError, load_config
from rlstack.errors import UserError
from tests.e2e.runs import ROOT

TINY = os.path.join(ROOT, "yaml_configs", "tiny_cpu.yaml")


# ----------------------------------------------------------------------------- the lock


def _hold(out, ready, release):
    lock = run_dir.RunLock(out)
    lock.acquire()
    ready.set()
    release.wait(30)
    lock.release()


def _try(out, barrier, results):
    barrier.wait()
    lock = run_dir.RunLock(out)
    try:
        lock.acquire()
        results.put("won")
        barrier.wait()  # hold it until every racer has tried
        lock.release()
    except UserError as e:
        results.put(str(e))
        barrier.wait()


def test_a_live_run_refuses_a_second_naming_host_pid_and_since(tmp_path):
    out = str(tmp_path / "run")
    ctx = mp.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(out, ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        info = run_dir.holder(out)
        assert info["pid"] == holder.pid
        with pytest.raises(UserError) as e:
            run_dir.RunLock(out).acquire()
        text = str(e.value)
        assert f"PID {holder.pid}" in text and "host " in text and "since " in text, text
        assert "trainer.output_dir" in text and "\n" not in text
    finally:
        release.set()
        holder.join(30)
    assert run_dir.holder(out) is None  # released on a clean end
    assert not os.path.exists(os.path.join(out, run_dir.LOCK_FILE))


def test_a_stale_lock_of_a_killed_holder_is_taken_over(tmp_path):
    out = str(tmp_path / "run")
    ctx = mp.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(out, ready, release))
    holder.start()
    assert ready.wait(30)
    holder.kill()  # SIGKILL: no release, the lock file stays behind with the dead holder's PID
    holder.join(30)
    assert os.path.exists(os.path.join(out, run_dir.LOCK_FILE))
    assert run_dir.holder(out) is None
    lock = run_dir.RunLock(out)
    lock.acquire()
    assert json.load(open(os.path.join(out, run_dir.LOCK_FILE)))["pid"] == os.getpid()
    lock.release()


def test_racing_starts_get_exactly_one_lock(tmp_path):
    out = str(tmp_path / "run")
    ctx = mp.get_context("fork")
    n = 6
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_try, args=(out, barrier, results)) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    answers = [results.get(timeout=5) for _ in range(n)]
    assert answers.count("won") == 1, answers
    assert all("in use by a live run" in a for a in answers if a != "won")


def _hold_stale(out, ready, release):
    """A rank 0 that has taken the lock but not yet written its name: a killed run's name is still in the file."""
    import fcntl

    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, run_dir.LOCK_FILE)
    with open(path, "w") as f:
        json.dump({"host": "elsewhere", "pid": 1, "since": 0.0, "job": "killed-run@x:1"}, f)
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    ready.set()
    release.wait(30)
    os.close(fd)


def test_another_rank_never_refuses_its_own_job_while_rank_0_takes_the_lock(tmp_path, monkeypatch):
    """The killed-run resume race (seen in CI): rank 1's preflight read the lock between rank 0's flock
    and its name being written, found the killed run's name, and refused its own job (exit 2, silent)."""
    from rlstack.preflight import check_output_dir

    out = str(tmp_path / "run")
    ctx = mp.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_stale, args=(out, ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        cfg = load_config(TINY, [f"trainer.output_dir={out}"])
        monkeypatch.setenv("RANK", "1")
        check_output_dir(cfg)  # rank 0 owns the lock check
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(UserError, match="in use by a live run"):  # rank 0 (or --validate-only) still refuses
            check_output_dir(cfg)
    finally:
        release.set()
        holder.join(30)


# ----------------------------------------------------------------------------- overwrite


def _earlier_run(out):
    ckpt = os.path.join(out, "checkpoints", "step_00000002")
    os.makedirs(ckpt)
    open(os.path.join(ckpt, "weights"), "w").write("old weights")
    open(os.path.join(out, "checkpoints", "latest"), "w").write("step_00000002\n")
    open(os.path.join(out, "metrics.jsonl"), "w").write('{"step": 1}\n{"step": 2}\n')
    open(os.path.join(out, "config.yaml"), "w").write("old: config\n")


def _tree(path):
    found = {}
    for dirpath, _, names in os.walk(path):
        for name in names:
            full = os.path.join(dirpath, name)
            found[os.path.relpath(full, path)] = open(full, "rb").read()
    return found


def _cfg(out, *extra):
    return load_config(TINY, [f"trainer.output_dir={out}", "trainer.overwrite=true", *extra])


def test_overwrite_that_fails_puts_the_earlier_run_back_exactly(tmp_path):
    out = str(tmp_path / "run")
    _earlier_run(out)
    before = _tree(out)
    with pytest.raises(UserError):
        with run_dir.guarded_start(_cfg(out), rank=0) as overwrite:
            overwrite.begin()
            assert not os.path.exists(os.path.join(out, "metrics.jsonl"))  # set aside, not deleted
            os.makedirs(os.path.join(out, "checkpoints", "step_00000001.tmp"))  # the new run's half save
            open(os.path.join(out, "metrics.jsonl"), "w").write('{"step": 1, "new": true}\n')
            raise UserError("a reward function that raises at step 1")
    assert _tree(out) == before


def test_overwrite_is_removed_once_the_new_run_saves(tmp_path):
    out = str(tmp_path / "run")
    _earlier_run(out)
    with run_dir.guarded_start(_cfg(out), rank=0) as overwrite:
        overwrite.begin()
        os.makedirs(os.path.join(out, "checkpoints", "step_00000001"))
        overwrite.saved()
        assert not any(name.endswith(run_dir.ASIDE_SUFFIX) for name in os.listdir(out))
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step_00000001"]


def _killed_mid_overwrite(out):
    with run_dir.guarded_start(_cfg(out), rank=0) as overwrite:
        overwrite.begin()
        open(os.path.join(out, "metrics.jsonl"), "w").write('{"step": 1, "new": true}\n')
        os._exit(137)  # as SIGKILL: no finally, no restore


def test_a_run_killed_mid_overwrite_is_undone_by_the_next_start(tmp_path):
    out = str(tmp_path / "run")
    _earlier_run(out)
    before = _tree(out)
    child = mp.get_context("fork").Process(target=_killed_mid_overwrite, args=(out,))
    child.start()
    child.join(60)
    assert child.exitcode == 137
    assert os.path.exists(os.path.join(out, run_dir.RECORD_FILE))
    cfg = load_config(TINY, [f"trainer.output_dir={out}"])
    with run_dir.guarded_start(cfg, rank=0):
        pass
    after = _tree(out)
    after.pop(run_dir.LOCK_FILE, None)
    assert after == before


def test_a_run_refused_by_its_lock_or_checks_leaves_no_directory(tmp_path):
    out = str(tmp_path / "never")
    with pytest.raises(UserError):
        with run_dir.guarded_start(load_config(TINY, [f"trainer.output_dir={out}"]), rank=0):
            raise UserError("preflight refused the run")
    assert not os.path.exists(out)


# ----------------------------------------------------------------------------- pruning


def test_pruning_never_removes_the_checkpoint_just_published(tmp_path):
    from rlstack.checkpoint import MARKER, Checkpointer

    root = tmp_path / "checkpoints"
    for step in (4, 5, 8):  # resumed from 4, saved 5; 8 is a newer step of an abandoned branch
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}" / MARKER).write_text("{}")
    ckpt = Checkpointer.__new__(Checkpointer)
    ckpt.cfg = load_config(TINY, [f"checkpoint.dir={root}", "checkpoint.keep_last=1"])
    ckpt.root = str(root)
    ckpt._prune(str(root / "step_00000005"))
    assert sorted(os.listdir(root)) == ["step_00000005"]


# ----------------------------------------------------------------------------- user code, configs, paths


def _scorer(tmp_path, body):
    from rlstack.rewards import RewardScorer

    path = tmp_path / "reward.py"
    path.write_text(body)
    cfg = load_config(TINY, [f"data.reward_fn_file={path}"])
    return RewardScorer.from_config(cfg.data), str(path)


@pytest.mark.parametrize("exit_call", ["sys.exit(0)", "raise KeyboardInterrupt"])
def test_a_reward_function_that_exits_is_a_user_error_naming_it(tmp_path, exit_call):
    scorer, path = _scorer(
        tmp_path,
        f"import sys\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    {exit_call}\n",
    )
    with pytest.raises(UserError) as e:
        scorer.score("copy", "1", "1", {})
    assert "compute_score" in str(e.value) and path in str(e.value)


def test_a_reward_file_that_exits_at_import_is_a_user_error(tmp_path):
    with pytest.raises(UserError) as e:
        _scorer(tmp_path, "import sys\nsys.exit(0)\n")
    assert "reward.py" in str(e.value) and "SystemExit" in str(e.value)


def test_reward_functions_get_their_own_extra_info(tmp_path):
    from rlstack.rewards import Sample

    scorer, _ = _scorer(
        tmp_path,
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    extra_info['seen'] = extra_info.get('seen', 0) + 1\n"
        "    return float(extra_info['seen'])\n",
    )
    shared = {"index": 3}
    results = scorer.score_batch([Sample("copy", "1", "1", shared), Sample("copy", "1", "1", shared)])
    assert [r.score for r in results] == [1.0, 1.0]
    assert shared == {"index": 3}


def test_a_key_given_twice_names_file_key_and_both_lines(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("trainer:\n  output_dir: outputs/mine\nalgorithm:\n  actor_lr: 0.1\ntrainer:\n  total_steps: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    text = str(e.value)
    assert str(path) in text and "'trainer'" in text and "line 1" in text and "line 5" in text


def _validate(*overrides, env=None):
    return subprocess.run(
        [sys.executable, "-m", "rlstack.train", "--config", TINY, "--validate-only", "--world-size", "2", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, **(env or {})),
        timeout=120,
    )


def test_validate_only_refuses_an_unwritable_output_dir_naming_the_key(tmp_path):
    proc = _validate("trainer.output_dir=/proc/x")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: trainer.output_dir=/proc/x cannot be written")


def test_an_unusable_cache_is_named_by_its_variable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = _validate(f"trainer.output_dir={tmp_path / 'out'}", env={"RLSTACK_CACHE": str(blocker / "cache")})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "RLSTACK_CACHE" in proc.stderr.strip().splitlines()[-1], proc.stderr


def test_validate_only_refuses_an_empty_data_file(tmp_path):
    empty = tmp_path / "empty.parquet"
    _empty_parquet(str(empty))
    proc = _validate(f"trainer.output_dir={tmp_path / 'out'}", f"data.train_files=[{empty}]")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "has no rows" in proc.stderr and "data.train_files" in proc.stderr


def _empty_parquet(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "data_source": pa.array([], pa.string())}), path)


def test_validate_only_refuses_a_context_longer_than_the_model(tmp_path):
    proc = _validate(f"trainer.output_dir={tmp_path / 'out'}", "rollout.max_new_tokens=100000")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "max_position_embeddings" in line and "rollout.max_new_tokens" in line, line


def test_duplicate_train_files_are_a_warning(tmp_path):
    from rlstack.data.rows import write_jsonl

    data = tmp_path / "d.jsonl"
    write_jsonl([{"prompt": [{"role": "user", "content": "1"}], "data_source": "copy",
                  "reward_model": {"ground_truth": "1"}}], str(data))  # fmt: skip
    proc = _validate(f"trainer.output_dir={tmp_path / 'out'}", f"data.train_files=[{data},{data}]")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "data.train_files lists" in proc.stdout + proc.stderr and "more than once" in proc.stdout + proc.stderr


def test_validate_only_refuses_a_prompt_longer_than_max_prompt_length(tmp_path):
    from megatron_bridge.tiny import ensure_tiny_checkpoint
    from rlstack.data.rows import write_jsonl

    model = ensure_tiny_checkpoint()  # a local HF directory, tokenizer included
    data = tmp_path / "long.jsonl"
    row = {
        "prompt": [{"role": "user", "content": "7 " * 50}],
        "data_source": "copy",
        "reward_model": {"ground_truth": "7"},
    }
    write_jsonl([row], str(data))
    proc = _validate(
        f"trainer.output_dir={tmp_path / 'out'}", f"model.path={model}", f"data.train_files=[{data}]",
        "data.max_prompt_length=16",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "data.max_prompt_length=16" in line and str(data) in line, line


def test_validate_only_exits_1_when_the_plan_does_not_fit(tmp_path, monkeypatch, capsys):
    from rlstack import planner, train

    class Plan:
        fits = False

    monkeypatch.setattr(planner, "plan_for_validate", lambda *a, **k: Plan())
    monkeypatch.setattr(planner, "format_plan", lambda plan: "peak 99 GiB of 1 GiB: does not fit")
    args = train.parse_args(
        ["--config", TINY, "--validate-only", "--world-size", "2", f"trainer.output_dir={tmp_path}"]
    )
    assert train._run(args, rank=0) == 1
    assert "does not fit" in capsys.readouterr().out
