#!/usr/bin/env bash
# Every GPU measurement of issue 38 in one run of at most ~8 minutes, from the repository root:
#   COMMIT=<sha> OUT=<dir> bash bench/gpu_all.sh
# Installs the carried wheels (.gpu/wheels: hydra-core, omegaconf, antlr4; the machine has no network),
# then, each under its own timeout and never stopping the later parts: bench/gpu_train.py,
# bench/gpu_checkpoint.py and the CUDA tests. Writes into $OUT (at most 8 files): gpu_train.json,
# gpu_checkpoint.json, pytest.txt, machine.txt, log.txt, RESULTS-gpu-section.md.
# For a try on a CPU machine: SMOKE=1 (both scripts with --cpu-smoke) INSTALL=0 (no wheels) PY=<python>.
# Time limits (seconds) can be changed: TRAIN_S (300), CKPT_S (75), CKPT_PARTS (async), TESTS_S (200); TRAIN_MODELS
# (ref,hf); TEST_WORKERS (8, pytest-xdist); SKIP: the parts not to run, space-separated (e.g. "train");
# TEST_SELECT: a pytest -k expression (to rerun some CUDA tests).
set -u
OUT=${OUT:?set OUT to the folder for the results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" COMMIT=${COMMIT:-unknown}
PY=${PY:-python3}
TRAIN_S=${TRAIN_S:-300} CKPT_S=${CKPT_S:-75} TESTS_S=${TESTS_S:-200}
LOG="$OUT/log.txt"
exec > >(tee -a "$LOG") 2>&1
t_all=$(date +%s)
part() {  # part NAME SECONDS CMD...: run, print its exit code and time, never abort
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s)
    if [[ " ${SKIP:-} " == *" $name "* ]]; then echo "=== $name: skipped (SKIP)"; return; fi
    echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    echo "=== $name: exit $rc after $(( $(date +%s) - t0 ))s"
    echo "$name $rc $(( $(date +%s) - t0 ))" >> "$OUT/machine.txt"
}

{
  echo "date $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit $COMMIT"
  echo "gpu $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
  echo "cpus $(nproc)"
  echo "mem_gib $(awk '/MemTotal/ {printf "%.0f", $2/1048576}' /proc/meminfo)"
  $PY -c 'import platform, torch; print("python", platform.python_version()); print("torch", torch.__version__, "cuda", torch.version.cuda)'
  for m in transformers peft accelerate; do $PY -c "import $m; print('$m', $m.__version__)" 2>/dev/null || echo "$m none"; done
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
nvidia-smi || true

SMOKE_ARG=${SMOKE:+--cpu-smoke}
if [ "${INSTALL:-1}" = 1 ]; then
  part install 60 $PY -m pip install --quiet --no-deps --no-index .gpu/wheels/*.whl
  if ! $PY -c 'import hydra, omegaconf' 2>/dev/null; then  # e.g. an externally managed system Python
    part install-target 60 $PY -m pip install --quiet --no-deps --no-index --target .gpu/site .gpu/wheels/*.whl
    export PYTHONPATH="$PYTHONPATH:$PWD/.gpu/site"
  fi
fi
$PY -c 'import hydra, omegaconf, fsdpkit; print("hydra", hydra.__version__, "omegaconf", omegaconf.__version__, "fsdpkit", fsdpkit.__version__)'
# The C checksum extension for this Python (src/ travels without build outputs); without it the checkpoint
# figures would time the Python fallback.
[ -n "${SMOKE:-}" ] || part build-ext 60 $PY setup.py -q build_ext --inplace
$PY -c 'from fsdpkit.checkpoint import hashing; print("C row hash extension:", hashing._rowhash is not None)' || true

part train "$TRAIN_S" $PY -m torch.distributed.run --standalone --nproc-per-node 1 bench/gpu_train.py $SMOKE_ARG --models "${TRAIN_MODELS:-ref,hf}" \
    --out "$OUT/gpu_train.json" --budget-s $(( TRAIN_S - 35 ))
part checkpoint "$CKPT_S" $PY -m torch.distributed.run --standalone --nproc-per-node 1 bench/gpu_checkpoint.py $SMOKE_ARG \
    --size-gib 1 --runs 5 --parts "${CKPT_PARTS:-async}" --out "$OUT/gpu_checkpoint.json"
# -v: one line per test as it finishes, so a run cut by the time limit still shows what passed; the tests
# run side by side (-n: each is one rank, subprocesses mostly starting up; the GPU has room for all) and
# each under its own limit (pytest-timeout: a test that hangs is reported with its stack, the others go on)
TEST_ARGS=""
$PY -c 'import xdist' 2>/dev/null && TEST_ARGS="-n ${TEST_WORKERS:-8}"
$PY -c 'import pytest_timeout' 2>/dev/null && TEST_ARGS="$TEST_ARGS --timeout $(( TESTS_S - 20 ))"
[ -n "${TEST_SELECT:-}" ] && TEST_ARGS="$TEST_ARGS -k '$TEST_SELECT'"
part cuda-tests "$TESTS_S" bash -c "$PY -m pytest tests/cuda -ra -v -p no:cacheprovider $TEST_ARGS --durations=0 2>&1 \
    | tee '$OUT/pytest.txt'; exit \${PIPESTATUS[0]}"
part results-md 30 $PY bench/gpu_results_md.py --dir "$OUT" --out "$OUT/RESULTS-gpu-section.md"
echo "=== all parts: $(( $(date +%s) - t_all ))s"
ls -la "$OUT"
