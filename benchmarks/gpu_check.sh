#!/usr/bin/env bash
# GPU benchmark check in one command, sized for ~10 minutes on one lent H200:
#   bash benchmarks/gpu_check.sh            (results under $OUT when set, else /tmp/rlstack-gpu-check)
# That machine has torch + CUDA and transformers but no megatron-core, no vLLM and no network
# (FINDINGS.md). This script installs only what it can: megatron-core from wheels carried in .whl/
# (skipped when already importable). It then benchmarks yaml_configs/qwen2_0p5b_gsm8k_1gpu.yaml (PPO:
# actor + critic + reference, bf16, NCCL) on a random-weight Qwen2-0.5B-shaped model (no checkpoint
# can be carried) with the transformers rollout engine, a smaller batch and fixed-length responses so
# it fits, and prints the table last. TRL is not compared here (not installed there).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-/tmp/rlstack-gpu-check}
WORK=${RLSTACK_GPU_WORK:-/tmp/rlstack-gpu-work}
MODEL=${RLSTACK_GPU_MODEL:-/tmp/rlstack-random-qwen2-0.5b}
mkdir -p "$OUT_DIR" "$WORK"
T0=$(date +%s)
say() { echo "[gpu_check +$(( $(date +%s) - T0 ))s] $*"; }

"$PY" -c "import torch; assert torch.cuda.is_available(); print('torch', torch.__version__, torch.cuda.get_device_name(0))" \
  || { echo "gpu_check: needs a CUDA device and torch"; exit 2; }

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

say "random-weight Qwen2-0.5B-shaped checkpoint -> $MODEL"
"$PY" benchmarks/random_model.py --shape qwen2-0.5b --out "$MODEL" --dtype bfloat16 >"$WORK/model.log" 2>&1 \
  || { tail -20 "$WORK/model.log"; echo "gpu_check: could not build the random model"; exit 2; }

# The 0.5B config's model, parallel layout, algorithm (PPO) and dtype; rollout through the transformers
# engine (no vLLM there); synthetic arithmetic prompts instead of GSM8K files; 64 prompts x 256 new
# tokens so three steps, the stage micro-benchmarks and the ceilings fit in the time.
OVERRIDES=(model.path="$MODEL" rollout.engine=hf rollout.micro_batch_size=64 rollout.max_new_tokens=256
           data.train_files=[] data.val_files=[] data.synthetic=arith data.synthetic_train_size=512
           data.train_batch_size=64 algorithm.mini_batch_size=32 algorithm.micro_batch_size=8)
say "benchmark (log: $OUT_DIR/run.log)"
"$PY" benchmarks/run.py --config yaml_configs/qwen2_0p5b_gsm8k_1gpu.yaml --nproc 1 --steps 3 --reps 2 \
  --engines hf --skip trl --timeout-min 2.5 --out-dir "$OUT_DIR" --work-dir "$WORK" "${OVERRIDES[@]}" \
  >"$OUT_DIR/run.log" 2>&1
rc=$?
for part in trainer stages ceilings; do  # the parts' own logs come back with the results
  log="$WORK/qwen2_0p5b_gsm8k_1gpu/$part/bench.log"
  [ -f "$log" ] && cp "$log" "$OUT_DIR/$part.log"
done
grep -E '^== |[|] step_s |profile:|failed|skipped|Error' "$OUT_DIR/run.log" | tail -30
say "done (run.py exit code $rc)"
MD=$(ls -t "$OUT_DIR"/qwen2_0p5b_gsm8k_1gpu-*.md 2>/dev/null | head -1)
if [ -n "$MD" ]; then cat "$MD"; else tail -40 "$OUT_DIR/run.log"; fi
exit $rc
