"""launch/: SLURM node lists and layouts (pure), `ppo.sh --print-cmd` under faked SLURM and torchrun
environments, and short torchrun runs of ppo.sh against a stand-in `rlstack.train` (no model):
a failing rank ends the job naming that rank; two launchers on localhost form one world."""

import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PPO_SH = os.path.join(ROOT, "launch", "ppo.sh")
PPO_SBATCH = os.path.join(ROOT, "launch", "ppo.sbatch")
CLEARED = (
    "NNODES",
    "NODE_RANK",
    "NPROC_PER_NODE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RLSTACK_IGNORE_SLURM",
    "RLSTACK_VALIDATE",
    "CONSOLE_LOCAL_RANKS",
    "PYTHON",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
)


def _load_slurm_nodes():
    spec = importlib.util.spec_from_file_location("slurm_nodes", os.path.join(ROOT, "launch", "slurm_nodes.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["slurm_nodes"] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


sn = _load_slurm_nodes()


# ----------------------------------------------------------------------------- node lists


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("gpu01", ["gpu01"]),
        ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
        ("a[1-2],b[3,5-6]", ["a1", "a2", "b3", "b5", "b6"]),
        ("node-[001-003]", ["node-001", "node-002", "node-003"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
        ("gpu[9-10]", ["gpu9", "gpu10"]),
        ("x1,y2,z[3]", ["x1", "y2", "z3"]),
        ("dgx-a100-[5-6].cluster", ["dgx-a100-5.cluster", "dgx-a100-6.cluster"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert sn.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["", "gpu[01-", "gpu01]", "gpu[3-1]", "gpu[a-b]", "a,,b", "a[1-[2]]"])
def test_expand_nodelist_rejects_malformed(nodelist):
    with pytest.raises(ValueError, match="node list"):
        sn.expand_nodelist(nodelist)


@pytest.mark.parametrize(
    "text, count", [("8", 8), ("a100:8", 8), ("gpu:a100:4", 4), ("a100:4,v100:2", 6), ("4(IDX:0-3)", 4)]
)
def test_parse_gpu_count(text, count):
    assert sn.parse_gpu_count(text, "SLURM_GPUS_PER_NODE") == count


def test_parse_gpu_count_rejects_text():
    with pytest.raises(ValueError, match="NPROC_PER_NODE"):
        sn.parse_gpu_count("a100", "SLURM_GPUS_PER_NODE")


@pytest.mark.parametrize("visible, count", [("", 0), ("0,1,2", 3), ("-1", 0), ("GPU-abc,GPU-def", 2)])
def test_count_visible_gpus_reads_cuda_visible_devices(visible, count):
    assert sn.count_visible_gpus({"CUDA_VISIBLE_DEVICES": visible}) == count


# ----------------------------------------------------------------------------- layouts (pure)


def _layout(env, gpus=0):
    return sn.layout_from_env(env, gpus=lambda: gpus, free_port=lambda: 40123)


def test_env_layout_defaults():
    layout = _layout({})
    assert (layout.nnodes, layout.node_rank, layout.nproc_per_node) == (1, 0, 2)
    assert (layout.master_addr, layout.master_port, layout.source) == ("127.0.0.1", 40123, "env")
    assert any("NPROC_PER_NODE" in note for note in layout.notes)
    assert _layout({}, gpus=4).nproc_per_node == 4


def test_env_layout_multi_node_uses_fixed_default_port():
    layout = _layout({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"})
    assert (layout.nnodes, layout.node_rank, layout.master_port) == (2, 1, sn.DEFAULT_MASTER_PORT)


@pytest.mark.parametrize(
    "env, fix",
    [
        ({"NNODES": "2"}, "MASTER_ADDR"),
        ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"}, "NODE_RANK"),
        ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE"),
        ({"NNODES": "two"}, "NNODES"),
    ],
)
def test_env_layout_errors_name_the_variable(env, fix):
    with pytest.raises(ValueError, match=fix):
        _layout(env)


def test_slurm_layout_prefers_step_list_and_node_name():
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "n[1-4]",
        "SLURM_NNODES": "4",
        "SLURM_STEP_NODELIST": "n[3-4]",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURMD_NODENAME": "n4",
        "SLURM_NODEID": "3",
        "SLURM_GPUS_ON_NODE": "8",
    }
    layout = _layout(env)
    assert (layout.nnodes, layout.node_rank, layout.master_addr) == (2, 1, "n3")
    assert (layout.nproc_per_node, layout.master_port, layout.source) == (8, sn.SLURM_PORT_BASE + 7, "slurm")


def test_slurm_layout_environment_overrides_and_notes():
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_NODEID": "0",
        "SLURM_GPUS_ON_NODE": "8",
        "NPROC_PER_NODE": "2",
        "MASTER_ADDR": "10.1.1.1",
        "MASTER_PORT": "31000",
        "NNODES": "5",
    }
    layout = _layout(env)
    assert (layout.nnodes, layout.nproc_per_node, layout.master_addr, layout.master_port) == (2, 2, "10.1.1.1", 31000)
    assert any("NNODES=5 ignored" in note for note in layout.notes)
    assert _layout({**env, "RLSTACK_IGNORE_SLURM": "1"}).nnodes == 5


@pytest.mark.parametrize(
    "env, fix",
    [
        ({"SLURM_JOB_ID": "7"}, "SLURM_JOB_NODELIST"),
        ({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"}, "srun"),
        ({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODEID": "0", "SLURM_NNODES": "3"}, "srun"),
        ({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURMD_NODENAME": "m1"}, "not in the SLURM node list"),
        (
            {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": "x"},
            "NPROC_PER_NODE",
        ),
    ],
)
def test_slurm_layout_errors(env, fix):
    with pytest.raises(ValueError, match=fix):
        _layout(env)


# ----------------------------------------------------------------------------- ppo.sh --print-cmd


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM") and k not in CLEARED}
    env.update(PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    env.update(extra)
    return env


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"data:\n  synthetic: arith\ntrainer:\n  output_dir: {tmp_path / 'out'}\n")
    return str(path)


def _print_cmd(args, env, cwd=ROOT):
    result = subprocess.run(["bash", PPO_SH, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return _parse_torchrun(result.stdout.strip().splitlines()[-1])


def _parse_torchrun(line):
    """`python -m torch.distributed.run --k=v ... -m rlstack.train ARGS` -> ({k: v}, python, ARGS)."""
    words = shlex.split(line)
    assert words[1:3] == ["-m", "torch.distributed.run"]
    split = words.index("rlstack.train")
    assert words[split - 1] == "-m"
    flags = dict(w[2:].split("=", 1) for w in words[3 : split - 1])
    return flags, words[0], words[split + 1 :]


SLURM_SHAPES = [  # (node list, SLURM_NODEID, GPU variables, hosts)
    ("gpu01", "0", {"SLURM_GPUS_ON_NODE": "8"}, ["gpu01"]),
    ("gpu[01-04,07]", "4", {"SLURM_GPUS_ON_NODE": "8"}, ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("a[1-2],b[3,5-6]", "3", {"SLURM_GPUS_PER_NODE": "a100:4"}, ["a1", "a2", "b3", "b5", "b6"]),
    ("node-[001-003]", "1", {"SLURM_GPUS_PER_NODE": "2"}, ["node-001", "node-002", "node-003"]),
    (
        "r[1-2]-n[1-2]",
        "2",
        {"SLURM_GPUS_ON_NODE": "4", "SLURM_GPUS_PER_NODE": "8"},
        ["r1-n1", "r1-n2", "r2-n1", "r2-n2"],
    ),
]


@pytest.mark.parametrize("nodelist, node_id, gpu_env, hosts", SLURM_SHAPES, ids=[s[0] for s in SLURM_SHAPES])
def test_print_cmd_under_slurm(config, tmp_path, nodelist, node_id, gpu_env, hosts):
    env = _env(
        SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=nodelist, SLURM_NODEID=node_id, SLURM_NNODES=str(len(hosts)), **gpu_env
    )
    flags, python, train_args = _print_cmd([config, "--print-cmd"], env)
    nproc = int(gpu_env.get("SLURM_GPUS_ON_NODE") or gpu_env["SLURM_GPUS_PER_NODE"].split(":")[-1])
    assert flags["nnodes"] == str(len(hosts))
    assert flags["node-rank"] == node_id
    assert flags["nproc-per-node"] == str(nproc)
    assert flags["master-addr"] == hosts[0]
    assert flags["master-port"] == str(sn.SLURM_PORT_BASE + 4242 % sn.SLURM_PORT_SPAN)
    assert flags["max-restarts"] == "0"
    assert flags["rdzv-conf"] == "timeout=1800"  # parallel.timeout_minutes (30) in seconds
    assert flags["log-dir"] == str(tmp_path / "out" / "torchrun_logs" / f"node{node_id}")
    assert python == sys.executable
    assert train_args == ["--config", config]


@pytest.mark.parametrize("position", [0, 1, 3])
def test_print_cmd_anywhere_and_arguments_pass_through(config, tmp_path, position):
    args = [config, "trainer.total_steps=3", "--dry-run", f"trainer.output_dir={tmp_path / 'other'}"]
    args.insert(position, "--print-cmd")
    flags, _, train_args = _print_cmd(args, _env(NPROC_PER_NODE="3"))
    assert train_args == [
        "--config",
        config,
        "trainer.total_steps=3",
        "--dry-run",
        f"trainer.output_dir={tmp_path / 'other'}",
    ]
    assert flags["log-dir"] == str(tmp_path / "other" / "torchrun_logs" / "node0")
    assert flags["nproc-per-node"] == "3"


def test_print_cmd_outside_slurm_two_nodes(config):
    env = _env(NNODES="2", NODE_RANK="1", NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    flags, _, _ = _print_cmd([config, "--print-cmd", "parallel.timeout_minutes=2"], env)
    assert {
        k: flags[k] for k in ("nnodes", "node-rank", "nproc-per-node", "master-addr", "master-port", "rdzv-conf")
    } == {
        "nnodes": "2",
        "node-rank": "1",
        "nproc-per-node": "1",
        "master-addr": "127.0.0.1",
        "master-port": "29555",
        "rdzv-conf": "timeout=120",
    }


def test_print_cmd_defaults_without_gpus(config):
    flags, _, _ = _print_cmd([config, "--print-cmd"], _env())
    assert (flags["nnodes"], flags["node-rank"], flags["nproc-per-node"]) == ("1", "0", "2")
    assert flags["master-addr"] == "127.0.0.1"
    assert 0 < int(flags["master-port"]) < 65536
    assert flags["local-ranks-filter"] == "0"
    flags, _, _ = _print_cmd([config, "--print-cmd"], _env(CUDA_VISIBLE_DEVICES="0,1,2,3", CONSOLE_LOCAL_RANKS="all"))
    assert flags["nproc-per-node"] == "4"
    assert "local-ranks-filter" not in flags


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["trainer.bogus=1"], {}, "error: unknown config key 'trainer.bogus'"),
        (["parallel.tp=0"], {}, "error: 'parallel.tp' is 0"),
        ([], {"NNODES": "2"}, "error: NNODES=2 needs MASTER_ADDR"),
        ([], {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "gpu[01-", "SLURM_NODEID": "0"}, "error: node list"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(config, args, env, message):
    result = subprocess.run(
        ["bash", PPO_SH, config, *args, "--print-cmd"],
        env=_env(**env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if not line.startswith("ppo.sh: ")]
    assert len(errors) == 1 and errors[0].startswith(message), result.stderr


def test_missing_config_is_a_user_error(tmp_path):
    result = subprocess.run(
        ["bash", PPO_SH, str(tmp_path / "nope.yaml"), "--print-cmd"],
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "not found" in result.stderr and "Traceback" not in result.stderr


def test_sbatch_runs_one_ppo_sh_per_node_through_srun(config, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun_log = tmp_path / "srun_args"
    # A stand-in srun: records its arguments and runs the command on "this node".
    (bin_dir / "srun").write_text(
        '#!/usr/bin/env bash\necho "$@" > "$SRUN_LOG"\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n'
    )
    (bin_dir / "srun").chmod(0o755)
    env = _env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SRUN_LOG=str(srun_log),
        SLURM_SUBMIT_DIR=ROOT,
        SLURM_JOB_ID="99",
        SLURM_JOB_NODELIST="gpu[01-02]",
        SLURM_NODEID="0",
        SLURM_GPUS_ON_NODE="8",
        RLSTACK_VALIDATE="config",
    )
    result = subprocess.run(
        ["bash", PPO_SBATCH, config, "--print-cmd"],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    flags, _, train_args = _parse_torchrun(result.stdout.strip().splitlines()[-1])
    assert (flags["nnodes"], flags["nproc-per-node"], flags["master-addr"]) == ("2", "8", "gpu01")
    assert train_args == ["--config", config]
    srun_args = srun_log.read_text().split()
    assert "--ntasks-per-node=1" in srun_args and "--kill-on-bad-exit=1" in srun_args


# ----------------------------------------------------------------------------- short torchrun runs

FAKE_TRAIN = """\
import os, sys, time
if "--validate-only" in sys.argv:
    with open(os.path.join(os.environ["FAKE_OUT"], "validate"), "w") as f:
        f.write(f"{os.environ['WORLD_SIZE']} {sys.argv[1:]}")
    sys.exit(int(os.environ.get("FAKE_VALIDATE_RC", "0")))
rank = int(os.environ["RANK"])
mode = os.environ["FAKE_MODE"]
print(f"rank {rank} of {os.environ['WORLD_SIZE']}", flush=True)
if mode == "allreduce":
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value)
    out = os.path.join(os.environ["FAKE_OUT"], f"rank{rank}")
    with open(out, "w") as f:
        f.write(f"{int(value.item())} {os.environ['WORLD_SIZE']} {sys.argv[1:]}")
    dist.destroy_process_group()
elif rank == 1:
    time.sleep(0.5)
    raise RuntimeError("rank one went wrong")
else:
    time.sleep(120)
"""


@pytest.fixture
def fake_train(tmp_path):
    """A directory to run ppo.sh from whose `rlstack.train` is a stand-in (python -m puts the working
    directory first on sys.path); every other rlstack module is the real one."""
    work = tmp_path / "work"
    (work / "rlstack").mkdir(parents=True)
    (work / "rlstack" / "__init__.py").write_text(f"__path__.append({os.path.join(ROOT, 'rlstack')!r})\n")
    (work / "rlstack" / "train.py").write_text(FAKE_TRAIN)
    return str(work)


def _run_launcher(args, env, cwd, timeout=180):
    proc = subprocess.Popen(
        ["bash", PPO_SH, *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return proc, timeout


def _finish(proc, timeout):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's own session: torchrun and its workers
        out, err = proc.communicate()
        pytest.fail(f"launcher hung; stderr:\n{err}")
    return proc.returncode, out, err


def test_failed_rank_ends_the_job_and_is_named(config, tmp_path, fake_train):
    env = _env(NPROC_PER_NODE="2", RLSTACK_VALIDATE="config", FAKE_MODE="fail", OMP_NUM_THREADS="1")
    rc, out, err = _finish(*_run_launcher([config], env, fake_train))
    assert rc != 0
    last = err.strip().splitlines()[-1]
    assert last.startswith("ppo.sh: rank 1 (local rank 1 on node 0") and "exit code 1" in last, err
    assert "RuntimeError: rank one went wrong" in err  # the failed rank's stderr tail
    log_dir = tmp_path / "out" / "torchrun_logs" / "node0"
    stderr_logs = sorted(log_dir.glob("*/attempt_0/*/stderr.log"))
    assert [p.parent.name for p in stderr_logs] == ["0", "1"]
    assert "rank one went wrong" in stderr_logs[1].read_text()
    assert "Root Cause" in (log_dir / "launcher.log").read_text()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launchers_on_localhost_form_one_world(config, tmp_path, fake_train):
    env = _env(
        NNODES="2",
        NPROC_PER_NODE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        RLSTACK_VALIDATE="config",
        FAKE_MODE="allreduce",
        FAKE_OUT=str(tmp_path),
        OMP_NUM_THREADS="1",
    )
    nodes = [
        _run_launcher([config, "trainer.total_steps=2"], {**env, "NODE_RANK": str(rank)}, fake_train) for rank in (0, 1)
    ]
    results = [_finish(*node) for node in nodes]
    for rc, _, err in results:
        assert rc == 0, err
    for rank in (0, 1):
        # all-reduce of (rank + 1) over both "nodes": 1 + 2; the world spans both launchers
        assert (tmp_path / f"rank{rank}").read_text() == f"3 2 ['--config', '{config}', 'trainer.total_steps=2']"
    assert (tmp_path / "out" / "torchrun_logs" / "node1" / "launcher.log").exists()


def test_validate_only_runs_the_trainer_check_once_with_the_world_size(config, tmp_path, fake_train):
    env = _env(
        NNODES="2",
        NODE_RANK="0",
        NPROC_PER_NODE="3",
        MASTER_ADDR="127.0.0.1",
        RLSTACK_VALIDATE="train",
        FAKE_OUT=str(tmp_path),
    )
    rc, out, err = _finish(
        *_run_launcher([config, "--validate-only", "trainer.total_steps=2", "--dry-run"], env, fake_train)
    )
    assert rc == 0, err
    assert (
        tmp_path / "validate"
    ).read_text() == f"6 ['--config', '{config}', 'trainer.total_steps=2', '--validate-only']"
    assert not (tmp_path / "out").exists()  # torchrun never started


def test_failed_validation_stops_before_torchrun(config, tmp_path, fake_train):
    env = _env(
        NPROC_PER_NODE="2",
        RLSTACK_VALIDATE="train",
        FAKE_OUT=str(tmp_path),
        FAKE_VALIDATE_RC="2",
        FAKE_MODE="allreduce",
    )
    rc, _, err = _finish(*_run_launcher([config], env, fake_train))
    assert rc == 2, err
    assert (tmp_path / "validate").read_text().startswith("2 ")
    assert not (tmp_path / "out").exists()
