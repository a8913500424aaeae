#!/usr/bin/env bash
# Issue 26's checks on a GPU machine, in one call (each step bounded, all output under $OUT).
#
#   bash bench/gpu_session.sh          # on the GPU machine, from the repository root
#   QUICK=1 OUT=/tmp/o bash bench/gpu_session.sh   # anywhere: tiny sizes (a dry run)
#
# Carries ml-collections and tensorboardX as wheels in .whl/ where the machine lacks them.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT to a folder for the results}
PY=${PY:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
quick=${QUICK:+--quick}
{ nvidia-smi -L 2>&1; $PY -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())"; git log -1 --format=%h 2>&1; } > "$OUT/versions.txt"
cat "$OUT/versions.txt"
date +%T
# step NAME SECONDS COMMAND...: COMMAND bounded by SECONDS, its output in $OUT/NAME.log;
# SECONDS 0 skips it (a second call can run what the first left out, e.g. only the LM:
# T_TESTS=0 T_TREES=0 T_TUNE=0 T_KERNELS=0 T_LM=400 bash bench/gpu_session.sh).
step() {
  local name=$1 seconds=$2
  shift 2
  [ "$seconds" = 0 ] && { echo "$name skipped"; return; }
  timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"; date +%T
}
# Compiled checks only: the interpreted ones run in CI on CPU.
step pytest "${T_TESTS:-150}" $PY -m pytest -q -n "${WORKERS:-6}" -rs -p no:cacheprovider \
  -k "not Interpret and not interpreted and not PlatformKernels and not train_py" \
  tests/test_kernels_pallas.py tests/test_mx.py tests/test_mosaic_gpu.py tests/test_tree_packed.py
tail -3 "$OUT/pytest.log" 2>/dev/null
# Trees first (the part furthest from its target), then the block-size sweep and single arrays
# (the backends were compared on 2026-11-27: PARTS=arrays,backends runs them again).
step gpu_trees "${T_TREES:-120}" $PY bench/gpu_kernels.py $quick --parts trees \
  --json "$OUT/gpu_trees.json"
step gpu_tune "${T_TUNE:-90}" $PY bench/gpu_kernels.py $quick --parts tune \
  --json "$OUT/gpu_tune.json"
step gpu_kernels "${T_KERNELS:-150}" $PY bench/gpu_kernels.py $quick --parts "${PARTS:-arrays}" \
  --json "$OUT/gpu_kernels.json"
# The GPU section from every part that finished (back here: add --write to rewrite BENCHMARKS.md).
parts=$(ls "$OUT"/gpu_trees.json "$OUT"/gpu_tune.json "$OUT"/gpu_kernels.json 2>/dev/null)
[ -n "$parts" ] && $PY bench/gpu_kernels.py --merge $parts > "$OUT/gpu_section.md" 2>&1
# The steps above stop at 510 s; the LM run (3 methods, each compiled) takes what is left of
# a 600 s call, which may not be enough: run it again alone (above) if it stops at 124.
lm_steps=${QUICK:+--steps 6 --log-every 2}
step gpu_lm "${T_LM:-80}" $PY -m bench.gpu_lm $quick ${lm_steps:---steps 60 --log-every 20} \
  --output "$OUT/gpu_lm.md"
