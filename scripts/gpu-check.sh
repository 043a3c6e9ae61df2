#!/usr/bin/env bash
# GPU check for a fresh CUDA machine: the `gpu`-marked tests, then the kernel benchmark.
#
# Uses the torch/triton/pytest already installed there (no downloads: the machine may be offline)
# and imports this checkout through PYTHONPATH rather than `pip install -e .` (which offline needs
# --no-build-isolation and rewrites that interpreter's site-packages). Results go to $OUT (or bench-out/gpu-check):
#   env.txt, pytest.log, junit.xml, kernel.json, kernel.log.  Whole run is bounded to ~5 minutes.
#
#   PYTHON=python3.12 bash scripts/gpu-check.sh        # pick the interpreter (default python3)
#   MARKERS="gpu or not slow" bash scripts/gpu-check.sh   # also run the CPU tests compiled on the GPU
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
MARKERS="${MARKERS:-gpu}"
OUT_DIR="${OUT:-bench-out/gpu-check}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

{
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  else
    echo "nvidia-smi: not found"
  fi
  "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__,
    "cuda", torch.version.cuda, "triton", triton.__version__, "cuda_available", torch.cuda.is_available())'
} 2>&1 | tee "$OUT_DIR/env.txt"
if ! "$PY" -c 'import torch, triton, numpy; assert torch.cuda.is_available()' 2>/dev/null; then
  echo "gpu-check: needs torch, triton and numpy importable by $PY and a visible CUDA device; see env.txt" >&2
  exit 2
fi

status=0
# Only files holding gpu-marked tests: other test modules may import packages this machine lacks.
mapfile -t files < <(grep -rl --include='test_*.py' 'mark.gpu' tests)
if ! "$PY" -m pytest --version >/dev/null 2>&1; then
  echo "gpu-check: pytest is not installed for $PY; skipping tests" | tee "$OUT_DIR/pytest.log"
  status=3
elif [ "${#files[@]}" -eq 0 ]; then
  echo "gpu-check: no gpu-marked tests found" | tee "$OUT_DIR/pytest.log"
else
  timeout 210 "$PY" -m pytest -m "$MARKERS" -q -p no:cacheprovider --junitxml="$OUT_DIR/junit.xml" "${files[@]}" \
    2>&1 | tee "$OUT_DIR/pytest.log"
  status=${PIPESTATUS[0]}
fi

timeout 90 "$PY" -m benchmarks.kernel_bench --out "$OUT_DIR/kernel.json" >"$OUT_DIR/kernel.log" 2>&1
bench=$?
cat "$OUT_DIR/kernel.log"
[ "$bench" -ne 0 ] && status=$((status == 0 ? 4 : status))
echo "gpu-check: tests exit ${status}, bench exit ${bench}; results in $OUT_DIR"
exit "$status"
