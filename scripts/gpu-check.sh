#!/usr/bin/env bash
# GPU check for a fresh CUDA machine (one H200 here), bounded to ~8 minutes. Results go to $1, or $OUT, or
# bench-out/gpu-check:
#   env.txt          the machine, torch, triton
#   install.log      the carried wheels (nixl, nixl-cu13, lmdb from .gpu-wheels/, see scripts/gpu-wheels.sh)
#                    installed into $OUT_DIR/site (the machine has no network)
#   pytest.log, junit.xml   the `gpu`-marked tests: the Triton kernels (decode, unified step, digest) against
#                    their references, and the GPU engine's tokens against the CPU reference backend's
#   kernel.json/.log kvrelay bench kernel: decode attention as a share of HBM bandwidth at 1k/8k/32k
#                    context (split-K and unified kernels), prefill TFLOP/s at 8k vs a bf16 matmul
#   serve.json/.log  a model with Llama-3.1-8B's shapes and random bf16 weights (`kvrelay tiny-model`),
#                    served by `kvrelay up` (1 prefill + 1 decode on the GPU), shared-prefix workload:
#                    TTFT and output tok/s (skipped with SERVE=0)
#
# Uses the torch/triton/pytest already installed there and imports this checkout through PYTHONPATH.
#   PYTHON=python3.12 bash scripts/gpu-check.sh [OUT_DIR]     # pick the interpreter (default python3)
#   MARKERS="gpu or not slow" LAYERS=8 SERVE=0 bash scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
MARKERS="${MARKERS:-gpu}"
OUT_DIR="${1:-${OUT:-bench-out/gpu-check}}"
LAYERS="${LAYERS:-32}"
SERVE="${SERVE:-1}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
export PYTHONPATH="$PWD:$OUT_DIR/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

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

# The packages the machine lacks, from the carried wheels (no index, no dependencies pulled).
if ls .gpu-wheels/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install --no-index --no-deps --target "$OUT_DIR/site" .gpu-wheels/*.whl >"$OUT_DIR/install.log" 2>&1 \
    || echo "gpu-check: installing .gpu-wheels failed; see install.log" >&2
else
  echo "gpu-check: no .gpu-wheels/ (run scripts/gpu-wheels.sh and carry it); nixl/lmdb must already be there" \
    | tee "$OUT_DIR/install.log"
fi
"$PY" -c 'import lmdb, nixl, xxhash, msgpack, aiohttp' >>"$OUT_DIR/install.log" 2>&1 \
  || echo "gpu-check: a package the tests need is missing; see install.log" >&2

status=0
mapfile -t files < <(grep -rl --include='test_*.py' 'mark.gpu' tests)
if ! "$PY" -m pytest --version >/dev/null 2>&1; then
  echo "gpu-check: pytest is not installed for $PY; skipping tests" | tee "$OUT_DIR/pytest.log"
  status=3
elif [ "${#files[@]}" -eq 0 ]; then
  echo "gpu-check: no gpu-marked tests found" | tee "$OUT_DIR/pytest.log"
else
  timeout 120 "$PY" -m pytest -m "$MARKERS" -q -p no:cacheprovider --junitxml="$OUT_DIR/junit.xml" "${files[@]}" \
    2>&1 | tee "$OUT_DIR/pytest.log"
  status=${PIPESTATUS[0]}
fi

timeout 90 "$PY" -m benchmarks.kernel_bench --out "$OUT_DIR/kernel.json" >"$OUT_DIR/kernel.log" 2>&1
bench=$?
tail -n 40 "$OUT_DIR/kernel.log"
[ "$bench" -ne 0 ] && status=$((status == 0 ? 4 : status))

serve=skipped
if [ "$SERVE" = "1" ]; then
  MODEL="$OUT_DIR/llama-8b-shapes"
  timeout 100 "$PY" -m deploy.cli tiny-model "$MODEL" --layers "$LAYERS" --hidden 4096 --heads 32 --kv-heads 8 \
    --intermediate 14336 --vocab 128256 --weights-dtype bfloat16 >"$OUT_DIR/serve.log" 2>&1
  cat >"$OUT_DIR/gpu.yaml" <<YAML
model: {path: $MODEL, name: llama-8b-shapes, dtype: bfloat16, device: cuda}
kvstore: {block_size_tokens: 16, device: {fraction_of_free: 0.35}, host: {bytes: 4GiB}}
engine: {max_num_seqs: 64, max_num_batched_tokens: 8192}
prefill: {ports: [18100]}
decode: {ports: [18200]}
router: {port: 18000}
YAML
  ( exec timeout 330 "$PY" -m deploy.cli up --config "$OUT_DIR/gpu.yaml" >"$OUT_DIR/up.log" 2>&1 ) &
  up_pid=$!
  # Both nodes load the 16 GB of weights: wait (bounded) for the router to report them ready.
  "$PY" - <<'PYWAIT' >>"$OUT_DIR/serve.log" 2>&1
import json, time, urllib.request
deadline = time.monotonic() + 150
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen("http://127.0.0.1:18000/health", timeout=2) as r:
            if json.loads(r.read()).get("status") == "ok":
                print("kvrelay up is ready"); break
    except Exception:
        pass
    time.sleep(1)
else:
    print("kvrelay up did not become ready in 150 s")
PYWAIT
  timeout 120 "$PY" -m deploy.cli bench serve --url http://127.0.0.1:18000 --model "$MODEL" --groups 4 \
    --prompts-per-group 8 --system-tokens 1024 --question-tokens 64 --output-tokens 64 --no-progress \
    --out-dir "$OUT_DIR/serve" >>"$OUT_DIR/serve.log" 2>&1
  serve=$?
  kill "$up_pid" 2>/dev/null; wait "$up_pid" 2>/dev/null
  [ -f "$OUT_DIR/serve/summary.json" ] && cp "$OUT_DIR/serve/summary.json" "$OUT_DIR/serve.json"
  tail -n 5 "$OUT_DIR/serve.log"
fi
echo "gpu-check: tests exit ${status}, kernel bench exit ${bench}, serve ${serve}; results in $OUT_DIR"
exit "$status"
