#!/usr/bin/env bash
# The GPU path checked in one command, sized for ~10 minutes on one lent H200:
#   bash benchmarks/gpu_check.sh          (results under $OUT when set, else /tmp/rlstack-gpu-check)
#   bash benchmarks/gpu_check.sh --cpu    (the very same checks on CPU at tiny shapes; `make test` runs it)
# Checks (benchmarks/device_check.py): NCCL collectives (gloo on CPU), bf16 PPO steps with actor, critic
# and reference, the weight sync into the rollout engine and its log-prob parity, a dist-checkpoint
# save and load, the planner's peak against the measured one (when rlstack/plan.py exists), step time
# and tokens/s. On a GPU, then the stage micro-benchmarks and ceilings (benchmarks/run.py); --bench
# adds them on CPU too, --no-bench drops them.
# Both modes run yaml_configs/qwen2_0p5b_gsm8k_1gpu.yaml (PPO, bf16) on a random-weight Qwen2 model (no
# checkpoint can be carried to the GPU machine): Qwen2-0.5B's shape on a GPU, a 2-layer one on CPU, with
# the transformers rollout engine and synthetic prompts. The GPU machine has torch + CUDA and
# transformers but no megatron-core, no vLLM and no network (the project's measurements (docs/)): megatron-core is installed
# from wheels carried in .whl/ when it is not importable.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=gpu
BENCH=""
for arg in "$@"; do
  case "$arg" in
    --cpu) MODE=cpu ;;
    --bench) BENCH=1 ;;
    --no-bench) BENCH=0 ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [--cpu] [--bench|--no-bench]"; exit 2 ;;
  esac
done
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x "$ROOT/.venv/bin/python" ] && [ "$MODE" = cpu ]; then
  PY=$ROOT/.venv/bin/python; else PY=python3; fi
OUT_DIR=${OUT:-/tmp/rlstack-$MODE-check}
WORK=${RLSTACK_GPU_WORK:-/tmp/rlstack-$MODE-work}
CONFIG=yaml_configs/qwen2_0p5b_gsm8k_1gpu.yaml
rm -rf "$OUT_DIR/check"  # the checks' run folders (metrics.jsonl appends): start clean
mkdir -p "$OUT_DIR" "$WORK"
T0=$(date +%s)
say() { echo "[gpu_check +$(( $(date +%s) - T0 ))s] $*"; }

if [ "$MODE" = gpu ]; then
  "$PY" -c "import torch; assert torch.cuda.is_available(); print('torch', torch.__version__, torch.cuda.get_device_name(0))" \
    || { echo "gpu_check: needs a CUDA device and torch (bash benchmarks/gpu_check.sh --cpu runs the CPU version)"; exit 2; }
  NPROC=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  SHAPE=qwen2-0.5b; THREADS=4; RESUME_TOL=(--resume-rtol 5e-2 --resume-atol 1e-5); BENCH=${BENCH:-1}
  # 64 prompts x 256 new tokens: four PPO steps, the resume, the micro-benchmarks and ceilings fit the time
  SIZES=(data.train_batch_size=64 algorithm.mini_batch_size=32 algorithm.micro_batch_size=8
         rollout.micro_batch_size=64 rollout.max_new_tokens=256 data.synthetic_train_size=512)
else
  "$PY" -c "import torch; print('torch', torch.__version__, '(CPU mode)')" || { echo "gpu_check: no torch"; exit 2; }
  NPROC=2
  # same machine, same layout: the resumed steps must repeat the first run's exactly
  SHAPE=qwen2-tiny; THREADS=1; RESUME_TOL=(--resume-rtol 0 --resume-atol 0); BENCH=${BENCH:-0}
  SIZES=(data.train_batch_size=8 algorithm.mini_batch_size=4 algorithm.micro_batch_size=2
         rollout.micro_batch_size=8 rollout.max_new_tokens=8 rollout.n=2 data.synthetic_train_size=64)
fi
MODEL=${RLSTACK_GPU_MODEL:-/tmp/rlstack-random-$SHAPE}

if ! "$PY" -c "import megatron.core" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    say "installing carried wheels: $(ls .whl | tr '\n' ' ')"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || { echo "gpu_check: pip could not install .whl/*.whl"; exit 2; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "gpu_check: megatron-core is not installed and no .whl/ folder was carried: download it with"
    echo "  pip download --no-deps --only-binary=:all: --python-version 3.12 \\"
    echo "    --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1"
    exit 2
  fi
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
"$PY" - <<'EOF' || { echo "gpu_check: imports failed (above)"; exit 2; }
import importlib
for name in ("megatron.core", "transformers", "safetensors", "yaml", "psutil", "matplotlib"):
    try:
        importlib.import_module(name)
    except ImportError as e:  # matplotlib only draws the chart; the rest are needed
        print(f"missing: {name} ({e})")
        if name != "matplotlib":
            raise
import megatron.core, torch, transformers
print("megatron-core", megatron.core.__version__, "| transformers", transformers.__version__)
EOF

say "random-weight ${SHAPE}-shaped checkpoint -> $MODEL"
"$PY" benchmarks/random_model.py --shape "$SHAPE" --out "$MODEL" --dtype bfloat16 >"$WORK/model.log" 2>&1 \
  || { tail -20 "$WORK/model.log"; echo "gpu_check: could not build the random model"; exit 2; }

# The 0.5B config's model, parallel layout, algorithm (PPO) and dtype; rollout through the transformers
# engine (no vLLM there); synthetic arithmetic prompts instead of GSM8K files.
OVERRIDES=(model.path="$MODEL" rollout.engine=hf data.train_files=[] data.val_files=[] data.synthetic=arith
           "${SIZES[@]}")
say "checks ($MODE, $NPROC ranks; logs under $OUT_DIR/check)"
"$PY" benchmarks/device_check.py --mode "$MODE" --config "$CONFIG" --nproc "$NPROC" --steps 4 \
  --threads "$THREADS" "${RESUME_TOL[@]}" --out-dir "$OUT_DIR/check" "${OVERRIDES[@]}"
rc=$?

if [ "$BENCH" = 1 ]; then
  say "benchmark (log: $OUT_DIR/run.log)"
  "$PY" benchmarks/run.py --config "$CONFIG" --nproc "$NPROC" --steps 3 --reps 2 \
    --engines hf --skip trl --timeout-min 2.5 --out-dir "$OUT_DIR" --work-dir "$WORK" "${OVERRIDES[@]}" \
    >"$OUT_DIR/run.log" 2>&1
  bench_rc=$?
  CONFIG_NAME=$(basename "$CONFIG" .yaml)
  for part in trainer stages ceilings; do  # the parts' own logs come back with the results
    log="$WORK/$CONFIG_NAME/$part/bench.log"
    [ -f "$log" ] && cp "$log" "$OUT_DIR/$part.log"
  done
  grep -E '^== |[|] step_s |profile:|failed|skipped|Error' "$OUT_DIR/run.log" | tail -30
  MD=$(ls -t "$OUT_DIR"/"$CONFIG_NAME"-*.md 2>/dev/null | head -1)
  if [ -n "$MD" ]; then cat "$MD"; else tail -40 "$OUT_DIR/run.log"; fi
  [ "$rc" = 0 ] && rc=$bench_rc
else
  echo "benchmark (stage micro-benchmarks, ceilings): skipped in --$MODE mode (--bench runs it)"
fi
say "done: gpu_check --$MODE $([ "$rc" = 0 ] && echo passed || echo "FAILED (exit $rc)")"
exit $rc
