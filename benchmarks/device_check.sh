#!/usr/bin/env bash
# Accelerator check for issue 13: the qdot bench and the Gemma 3 270M decode rows on the GPU
# path, results under $OUT (default results/device_check). Expected run time on one H200:
# ~4-5 min (jax import + compiles dominate), well inside the 6-minute budget; each part has
# its own timeout so one slow part cannot take the rest with it.
#
# The GPU machine has jax/flax/optax/orbax/chex/absl but not ml-collections (qjax.pipeline
# imports it) and not the Gemma GGUF package (238 MB, too big to carry), so:
#   * the Gemma rows use `benchmarks.peers --synthetic`: Gemma 3 270M's exact shapes with
#     random weights (the same cost per token; perplexity is not measured);
#   * ml-collections travels as a wheel. Prepare once, on the CPU machine, in the repo root:
#       echo /.whl/ >> .git/info/exclude
#       python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --implementation cp --platform manylinux2014_x86_64 -d .whl ml-collections==1.1.0
#     then run it through the device tool:
#       run(command='bash benchmarks/device_check.sh', carry=['.whl'], timeout_s=420)
set -uo pipefail
OUT=${OUT:-results/device_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
start=$(date +%s)
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  $PY -c 'import jax; print("jax", jax.__version__, jax.devices())'
} 2>&1 | tee "$OUT/device.txt"

# 1. qdot bench (4096 x 4096 and the 262144 x 640 head, M = 1 and 8): ratios to f32.
timeout 150 $PY -m benchmarks.qdot_bench --reps=5 --ms=1,8 2>&1 | tee "$OUT/qdot_bench.txt"

# 2. Gemma 3 270M decode rows (prefill 512, 64 decode steps at b1 and b8), one subprocess each.
timeout 240 $PY -m benchmarks.peers --synthetic --windows=0 \
  --rows=qjax-f32,qjax-bf16,qjax-int8,qjax-int4,qjax-w8a8 --out="$OUT/peers_gpu" \
  2>&1 | tee "$OUT/peers_gpu.txt"

echo "device_check: $(( $(date +%s) - start )) s" | tee -a "$OUT/device.txt"
