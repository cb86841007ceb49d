#!/usr/bin/env bash
# Start rlstack training under torchrun on this node; SLURM-aware. See docs/launch.md.
#
#   bash launch/ppo.sh CONFIG [key=value ...] [--dry-run] [--profile] [--validate-only] [--plan] [--print-cmd] [--max-restarts N]
#
# Outside SLURM: NNODES (1), NODE_RANK (0), NPROC_PER_NODE (GPUs present, else 2), MASTER_ADDR
# (127.0.0.1; required when NNODES>1), MASTER_PORT (a free port on one node, else 29500).
# Under SLURM (one srun task per node): nodes, node rank and master address come from SLURM's node
# list, processes per node from SLURM_GPUS_ON_NODE / SLURM_GPUS_PER_NODE, the port from the job id;
# NPROC_PER_NODE, MASTER_ADDR and MASTER_PORT still override. RLSTACK_IGNORE_SLURM=1 ignores SLURM.
# Other knobs: PYTHON (default <repo>/.venv/bin/python, else python3); RLSTACK_VALIDATE
# (auto | train | config: how the config is checked before torchrun starts); CONSOLE_LOCAL_RANKS
# (local ranks echoed to the console, default 0; `all` for every rank).
#
# --print-cmd (anywhere) prints the torchrun command and exits. --validate-only checks the config
# for this job's world size in one process and exits (with the memory plan's table); a run prints
# the plan in one line before it starts (--plan: the table). Per-rank logs: <trainer.output_dir>/
# torchrun_logs/node<NODE_RANK>/ (torchrun) and <trainer.output_dir>/logs/ (rlstack). A failed rank
# ends torchrun with a non-zero status and a final line naming that rank.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() { sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; }
die() { echo "error: $*" >&2; exit 2; }
note() { echo "ppo.sh: $*" >&2; }

# ---------------------------------------------------------------- arguments
print_cmd=0
max_restarts=0
validate_only=0
full_plan=0
config=""
train_args=()   # everything for rlstack.train after --config CONFIG
overrides=()    # the key=value subset, for reading the config here
while (($#)); do
  case "$1" in
    --print-cmd) print_cmd=1 ;;
    --validate-only) validate_only=1 ;;
    --plan) full_plan=1 ;;
    --max-restarts) (($# >= 2)) || die "--max-restarts needs a number"; max_restarts="$2"; shift ;;
    --max-restarts=*) max_restarts="${1#--max-restarts=}" ;;
    -h|--help) usage; exit 0 ;;
    --config) (($# >= 2)) || die "--config needs a file"; config="$2"; shift ;;
    --config=*) config="${1#--config=}" ;;
    -*) train_args+=("$1") ;;
    *=*) train_args+=("$1"); overrides+=("$1") ;;
    *)
      [[ -z "$config" ]] || die "unexpected argument '$1': pass one CONFIG, then key=value overrides"
      config="$1" ;;
  esac
  shift
done
[[ "$max_restarts" =~ ^[0-9]+$ ]] || die "--max-restarts $max_restarts: give a whole number (0: a failed rank ends the job)"
[[ -n "$config" ]] || { usage; die "no config: bash launch/ppo.sh yaml_configs/X.yaml [key=value ...]"; }

if [[ -n "${PYTHON:-}" ]]; then
  command -v "$PYTHON" >/dev/null || die "PYTHON=$PYTHON is not an executable: point it at a python with rlstack's dependencies"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then
  PYTHON="$ROOT/.venv/bin/python"
else
  PYTHON="$(command -v python3)" || die "no $ROOT/.venv/bin/python and no python3: run 'make install' or set PYTHON"
  note "no $ROOT/.venv; using $PYTHON (set PYTHON to choose)"
fi
# The workers import rlstack from this checkout even when it is not pip-installed.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# ---------------------------------------------------------------- where this node sits
layout="$("$PYTHON" "$ROOT/launch/slurm_nodes.py" layout)" || exit $?
while IFS='=' read -r key value; do
  case "$key" in
    NNODES) nnodes="$value" ;;
    NODE_RANK) node_rank="$value" ;;
    NPROC_PER_NODE) nproc="$value" ;;
    MASTER_ADDR) master_addr="$value" ;;
    MASTER_PORT) master_port="$value" ;;
    LAYOUT_SOURCE) ;;
    *) die "internal: unexpected layout line '$key=$value'" ;;
  esac
done <<<"$layout"
world_size=$((nnodes * nproc))

# ---------------------------------------------------------------- the config
# Reading the config here (no torch) checks its schema and gives the output directory; a user
# error prints one line and exits 2 before any torchrun traceback could bury it.
read_config='import sys
from rlstack.config import load_config, timeout_minutes
from rlstack.observability.logging import user_error_guard
cfg = user_error_guard(lambda: load_config(sys.argv[1], sys.argv[2:]), rank=0)
print(cfg.trainer.output_dir)
# Rendezvous: how long a node may take to arrive (GPU clusters start nodes slowly).
print(round(timeout_minutes(cfg, on_gpu=True) * 60))'
cfg_lines="$("$PYTHON" -c "$read_config" "$config" ${overrides[@]+"${overrides[@]}"})" || exit $?
{ read -r output_dir; read -r rendezvous_s; } <<<"$cfg_lines"

validate_mode="${RLSTACK_VALIDATE:-auto}"
if [[ "$validate_mode" == auto ]]; then
  # rlstack.train --validate-only also checks the parallel layout against the world size.
  if [[ -f "$ROOT/rlstack/train.py" ]]; then validate_mode=train; else validate_mode=config; fi
fi
case "$validate_mode" in
  train|config) ;;
  *) die "RLSTACK_VALIDATE=$validate_mode: use auto, train or config" ;;
esac

run_validation() {
  [[ "$validate_mode" == train ]] || return 0
  local summary=()
  ((validate_only || full_plan)) || summary=(--plan-summary)
  WORLD_SIZE="$world_size" "$PYTHON" -m rlstack.train --config "$config" \
    ${overrides[@]+"${overrides[@]}"} --validate-only ${summary[@]+"${summary[@]}"}
}

# ---------------------------------------------------------------- the torchrun command
log_dir="$output_dir/torchrun_logs/node$node_rank"
console_ranks="${CONSOLE_LOCAL_RANKS:-0}"
cmd=("$PYTHON" -m torch.distributed.run
  --nnodes="$nnodes" --nproc-per-node="$nproc" --node-rank="$node_rank"
  --master-addr="$master_addr" --master-port="$master_port"
  # Static rendezvous: a node that never arrives fails the job after the config's timeout.
  --rdzv-conf="timeout=$rendezvous_s"
  # Elastic restarts (--max-restarts N, default 0): a failed rank restarts every rank on this node,
  # which resume from the latest checkpoint; with 0 a failed rank ends the job and names itself.
  --max-restarts="$max_restarts"
  --log-dir="$log_dir" --tee=3)
[[ "$console_ranks" == all ]] || cmd+=(--local-ranks-filter="$console_ranks")
cmd+=(-m rlstack.train --config "$config" ${train_args[@]+"${train_args[@]}"})

if ((print_cmd)); then
  printf '%q ' "${cmd[@]}" | sed 's/ $//'
  echo
  exit 0
fi
if ((validate_only)); then
  [[ "$validate_mode" == train ]] || note "config checked against the schema only (RLSTACK_VALIDATE=config)"
  run_validation
  exit $?
fi
run_validation || exit $?

# ---------------------------------------------------------------- run
# NCCL: a failed or timed-out collective aborts the communicator and raises, instead of hanging.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
# Megatron's TP layers issue async all-reduces that overlap the weight-gradient GEMMs only if the
# GPU runs kernels in issue order (megatron/core/tensor_parallel/layers.py); speed, not correctness.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
export PYTHONUNBUFFERED="${PYTHONUNBUFFERED:-1}"
# Each rank sets its own thread count (parallel.threads_per_rank); set here, torchrun has nothing to
# announce (it prints a banner when it sets OMP_NUM_THREADS itself).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# The first stop signal goes to the ranks only (below), so torchrun's SIGKILL 30 s after forwarding one
# does not apply: the ranks keep trainer.stop_grace_s in full (rlstack.preemption.clamp_grace).
export RLSTACK_SIGNALS_TO_RANKS=1
mkdir -p "$log_dir"
stopped_file="$output_dir/stopped_to_resume.json"   # rank 0 writes it when it stopped to be resumed
rm -f "$stopped_file"
launcher_log="$log_dir/launcher.log"   # torchrun's stderr on this node: its failure summary
fifo_dir="$(mktemp -d)"
trap 'rm -rf "$fifo_dir"' EXIT
mkfifo "$fifo_dir/stderr"
# The console gets the ranks' own lines; torchrun's own (its failure box, restarts, SIGTERM notes)
# go to launcher.log only: a failed run's last console line is the failed rank's error, below.
# srun and scancel (--signal=USR1 too) signal every process of the job step, not only this script.
# The console pipeline ignores TERM, INT and USR1 (it ends when torchrun closes its stderr), and
# torchrun ignores USR1: it handles TERM, INT, HUP and QUIT (forwarding them) but USR1's default
# action would end it, and with it every rank (PR_SET_PDEATHSIG). The ranks set their own handlers
# (trainer.stop_signals).
trap '' TERM INT USR1
tee -i "$launcher_log" <"$fifo_dir/stderr" | grep --line-buffered -E '^\[[a-z]+[0-9]+\]:' >&2 &
tee_pid=$!
trap - TERM INT
"${cmd[@]}" 2>"$fifo_dir/stderr" &
run_pid=$!
# A first TERM, INT or USR1 (a scheduler's warning, preemption, Ctrl-C) goes straight to the ranks:
# they finish the step, save it and exit 75 (trainer.stop_signals; torchrun itself would kill them
# 30 s after forwarding). A second signal, or HUP, goes to torchrun, which stops its workers now.
stop_signal=""
forward() {
  if [[ -z "$stop_signal" && "$1" != HUP ]]; then
    stop_signal="$1"
    pkill "-$1" -P "$run_pid" 2>/dev/null || kill -TERM "$run_pid" 2>/dev/null || true
  else
    # Stop now: the ranks take the same signal again within seconds as the same stop (srun repeats
    # it, rlstack.preemption.DUPLICATE_S), so they get the other of TERM/INT, then torchrun TERM.
    local first="$stop_signal" now=INT
    stop_signal="$1"
    if [[ -n "$first" ]]; then
      [[ "$first" != INT ]] || now=TERM
      pkill "-$now" -P "$run_pid" 2>/dev/null || true
    fi
    kill -TERM "$run_pid" 2>/dev/null || true
  fi
}
trap 'forward TERM' TERM
trap 'forward INT' INT
trap 'forward USR1' USR1
trap 'forward HUP' HUP
rc=0
wait "$run_pid" || rc=$?
while kill -0 "$run_pid" 2>/dev/null; do   # a trapped signal interrupted wait: wait again
  rc=0
  wait "$run_pid" || rc=$?
done
wait "$tee_pid" || true
trap - TERM INT USR1 HUP

if [[ -f "$stopped_file" ]]; then
  # Stopped to be resumed (a signal or a time limit): the last complete step is saved.
  note "stopped to be resumed ($(cat "$stopped_file")); exit 75: run again (checkpoint.resume=auto) to continue"
  if [[ "${RLSTACK_REQUEUE:-0}" == 1 && -n "${SLURM_JOB_ID:-}" && "${RLSTACK_IGNORE_SLURM:-0}" != 1 ]]; then
    if [[ "$node_rank" == 0 ]]; then
      if scontrol requeue "$SLURM_JOB_ID"; then
        note "requeued SLURM job $SLURM_JOB_ID (RLSTACK_REQUEUE=1): it resumes from the checkpoint"
      else
        note "scontrol requeue $SLURM_JOB_ID failed: submit the job again to resume"
      fi
    fi
  fi
  exit 75
fi
if ((rc == 0)); then
  exit 0
fi
if [[ -n "$stop_signal" ]]; then
  note "stopped by SIG$stop_signal on node $node_rank (torchrun exit status $rc); logs in $log_dir"
  exit $((128 + $(kill -l "$stop_signal")))
fi

# torchrun's summary ends with "Root Cause (first observed failure)": global rank, local rank,
# host and exit code of the rank that failed first.
read -r failed_rank failed_local failed_host failed_code failed_signal < <(awk '
  /^Root Cause/ { found = 1 }
  found && $1 == "host" && host == "" { host = $3 }
  found && $1 == "rank" && rank == "" { rank = $3; local_rank = $5; sub(/\)$/, "", local_rank) }
  found && $1 == "exitcode" && code == "" { code = $3; sig = ($6 ~ /^\(SIG/) ? $6 : "-" }
  END { if (rank != "") print rank, local_rank, host, code, sig }' "$launcher_log") || true

if [[ -z "${failed_rank:-}" ]]; then
  note "torchrun exited with status $rc on node $node_rank before reporting a failed rank; its last lines ($launcher_log):"
  tail -n 8 "$launcher_log" | sed 's/^/  | /' >&2
  exit "$rc"
fi
failed_log="$(ls -td "$log_dir"/*/attempt_*/"$failed_local"/stderr.log 2>/dev/null | head -n 1 || true)"
# Show the failed rank's last lines unless the console already showed its output.
if [[ -s "$failed_log" && "$console_ranks" != all && ",$console_ranks," != *",$failed_local,"* ]]; then
  note "last lines of rank $failed_rank's stderr ($failed_log):"
  tail -n 20 "$failed_log" | sed 's/^/  | /' >&2
fi
signal_text=""
[[ "$failed_signal" == - ]] || signal_text=" $failed_signal"
note "rank $failed_rank (local rank $failed_local on node $node_rank, host $failed_host) failed with exit code $failed_code$signal_text; logs in $log_dir and $output_dir/logs"
# The last console line is the failed rank's own error line: from its stderr (bugs, and user
# errors on rank 0), else from its rlstack log (other ranks keep user errors off the console).
err_line=""
if [[ -s "$failed_log" ]]; then
  err_line="$(grep -E '^error: ' "$failed_log" | grep -v 'this is a bug in rlstack, not a mistake' | tail -n 1 || true)"
fi
rank_log="$output_dir/logs/rank$failed_rank.log"
if [[ -z "$err_line" && -f "$rank_log" ]]; then
  err_line="$(grep -E ' ERROR rlstack: (user error|internal error \(bug\)): ' "$rank_log" | tail -n 1 \
    | sed -E 's/^.* ERROR rlstack: (user error: )?/error: /' || true)"
fi
[[ -z "$err_line" ]] || echo "$err_line" >&2
# A positive exit code is the rank's own (2: a user error); signals leave torchrun's status.
if [[ "$failed_code" =~ ^[0-9]+$ ]] && ((failed_code > 0)); then
  exit "$failed_code"
fi
exit "$rc"
