#!/usr/bin/env bash
# The lent GPU machine's one call (BUILD_NOTES.md, "GPU"): the benchmarks on the GPU and the suite
# on the CPU platform of that machine's JAX, side by side, every result under $OUT.
#
#   bash scripts/gpu_check.sh                 # on the device machine (the device tool sets OUT)
#   GPU_CHECK_SIZE=quick GPU_CHECK_TESTS=tests/test_schedule_tables.py bash scripts/gpu_check.sh  # a dry run
#
# The MLP's table includes `--probe-runtime-row` (decision 0018's open question on a GPU).
# The suite runs on every core but the first three (pinned with taskset), `gpu.py` on those three,
# so the GPU's timings and compile times share no core with the tests. Each part has its own
# timeout, so a slow part still leaves the others' output; the suite is stopped with SIGINT, which
# makes pytest print its summary. Files under $OUT: env.txt, gpu_mlp.md, gpu_transformer.md,
# their .err logs (one line per compiled program), suite.log and hlo.tgz (each program's optimised
# HLO, for counting kernels per tick).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/gpu_check}
SIZE=${GPU_CHECK_SIZE:-full}
TESTS=${GPU_CHECK_TESTS:-tests pipejax}
SUITE_SECONDS=${GPU_CHECK_SUITE_SECONDS:-520}
PY=${PYTHON:-python3}
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
mkdir -p "$OUT"

cores=$(nproc)
pin() {  # pin FIRST LAST COMMAND...: run on cores FIRST..LAST where taskset exists
    local first=$1 last=$2
    shift 2
    if command -v taskset >/dev/null && ((cores > 4)); then taskset -c "$first-$last" "$@"; else "$@"; fi
}
workers=$((cores > 4 ? cores - 3 : 2))
{
    date -u
    echo "cores $cores, suite workers $workers, git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    "$PY" -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__); print(jax.devices())'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
} >"$OUT/env.txt" 2>&1

# shellcheck disable=SC2086  # TESTS is a list of paths
(
    JAX_PLATFORMS=cpu pin 3 $((cores - 1)) timeout -s INT "$SUITE_SECONDS" "$PY" -m pytest -n "$workers" \
        -p no:cacheprovider --maxschedchunk=1 --deselect tests/test_docs.py::test_docs_site \
        --durations=15 -q $TESTS >"$OUT/suite.log" 2>&1
    echo "suite exit status $? after $SECONDS s" >>"$OUT/suite.log"
) &

mlp_rows=${GPU_CHECK_MLP_ROWS:-}
tf_rows=${GPU_CHECK_TRANSFORMER_ROWS:-scan,gpipe never,gpipe always,1f1b never,1f1b always,zb-h1 never,v-half never,circular}
pin 0 2 timeout 150 "$PY" benchmarks/gpu.py --size "$SIZE" ${mlp_rows:+--rows "$mlp_rows"} --probe-runtime-row \
    --dump-hlo "$OUT/hlo/mlp" >"$OUT/gpu_mlp.md" 2>"$OUT/gpu_mlp.err"
echo "gpu.py mlp exit status $? at $SECONDS s" >>"$OUT/gpu_mlp.err"
pin 0 2 timeout 330 "$PY" benchmarks/gpu.py --size "$SIZE" --model transformer --rows "$tf_rows" --rounds 6 \
    --dump-hlo "$OUT/hlo/transformer" >"$OUT/gpu_transformer.md" 2>"$OUT/gpu_transformer.err"
echo "gpu.py transformer exit status $? at $SECONDS s" >>"$OUT/gpu_transformer.err"

wait
tar czf "$OUT/hlo.tgz" -C "$OUT" hlo && rm -rf "$OUT/hlo"
echo "done at $SECONDS s" >>"$OUT/env.txt"
