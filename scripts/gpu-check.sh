#!/usr/bin/env bash
# GPU check for a fresh CUDA machine (one H200 here), bounded to 8 minutes by one deadline. At most 8 small
# files go to $1, or $OUT, or bench-out/gpu-check (the device tool brings back few, small files); everything
# else (installed wheels, the 16 GB model, logs of `kvrelay up`) stays in $WORK (default /tmp/kvrelay-gpu-check):
#   setup.log        the machine, torch, triton; the carried wheels (nixl, nixl-cu13, lmdb from .gpu-wheels/,
#                    see scripts/gpu-wheels.sh) installed offline into $WORK/site
#   pytest.log, junit.xml   the `gpu`-marked tests: the Triton kernels (decode, unified step, digest) against
#                    their references, the CUDA store (pinned host, side-stream copies), NVML, and the GPU
#                    engine's tokens against the CPU reference backend's
#   kernel.json, kernel.log   kvrelay bench kernel: decode attention as a share of HBM bandwidth at 1k/8k/32k
#                    context (split-K and unified kernels), prefill TFLOP/s vs a bf16 matmul in the same run
#   graphs.log       kvrelay bench cuda-graphs: median decode step, CUDA graph vs eager, batch 1 and 8, 1k context,
#                    on a model with SmolLM2-135M's shapes (random bf16), then on the 8B-shaped one if time is left
#   serve.json, serve.log     a model with Llama-3.1-8B's shapes and random bf16 weights (`kvrelay tiny-model`),
#                    served by `kvrelay up` (1 prefill + 1 decode on the GPU), shared-prefix workload: TTFT
#                    and output tok/s, after one warm-up request (skipped with SERVE=0 or when time is short)
#
# Uses the torch/triton/pytest already installed there and imports this checkout through PYTHONPATH.
#   PYTHON=python3.12 bash scripts/gpu-check.sh [OUT_DIR]     # pick the interpreter (default python3)
#   MARKERS="gpu or not slow" LAYERS=8 SERVE=0 BUDGET_S=480 bash scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
MARKERS="${MARKERS:-gpu}"
OUT_DIR="${1:-${OUT:-bench-out/gpu-check}}"
WORK="${WORK:-${TMPDIR:-/tmp}/kvrelay-gpu-check}"
LAYERS="${LAYERS:-32}"
SERVE="${SERVE:-1}"
END=$((SECONDS + ${BUDGET_S:-470}))
mkdir -p "$OUT_DIR" "$WORK"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
export PYTHONPATH="$PWD:$WORK/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

left() {  # seconds a stage may take: its cap, or what is left before the deadline
  local rest=$((END - SECONDS))
  echo $(( rest < $1 ? (rest > 1 ? rest : 1) : $1 ))
}

{
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  else
    echo "nvidia-smi: not found"
  fi
  "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__,
    "cuda", torch.version.cuda, "triton", triton.__version__, "cuda_available", torch.cuda.is_available())'
  if ls .gpu-wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" .gpu-wheels/*.whl \
      || echo "gpu-check: installing .gpu-wheels failed"
  else
    echo "gpu-check: no .gpu-wheels/ (run scripts/gpu-wheels.sh and carry it); nixl/lmdb must already be there"
  fi
  "$PY" -c 'import lmdb, nixl, xxhash, msgpack, aiohttp; print("imports ok: lmdb nixl xxhash msgpack aiohttp")'
} >"$OUT_DIR/setup.log" 2>&1
cat "$OUT_DIR/setup.log"
if ! "$PY" -c 'import torch, triton, numpy; assert torch.cuda.is_available()' 2>/dev/null; then
  echo "gpu-check: needs torch, triton and numpy importable by $PY and a visible CUDA device; see setup.log" >&2
  exit 2
fi

status=0
mapfile -t files < <(grep -rl --include='test_*.py' 'mark.gpu' tests)
if ! "$PY" -m pytest --version >/dev/null 2>&1; then
  echo "gpu-check: pytest is not installed for $PY; skipping tests" | tee "$OUT_DIR/pytest.log"
  status=3
else
  xdist=()
  "$PY" -c 'import xdist' 2>/dev/null && xdist=(-n 4)  # compile the kernels' variants in parallel
  timeout "$(left 170)" "$PY" -m pytest -m "$MARKERS" -q -p no:cacheprovider "${xdist[@]}" --timeout 90 \
    --junitxml="$OUT_DIR/junit.xml" "${files[@]}" 2>&1 | tail -n 200 >"$OUT_DIR/pytest.log"
  status=${PIPESTATUS[0]}
  tail -n 15 "$OUT_DIR/pytest.log"
fi

timeout "$(left 90)" "$PY" -m kvrelay.benchmarks.kernel_bench --out "$OUT_DIR/kernel.json" >"$OUT_DIR/kernel.log" 2>&1
bench=$?
tail -n 20 "$OUT_DIR/kernel.log"
[ "$bench" -ne 0 ] && status=$((status == 0 ? 4 : status))

SMALL="$WORK/smollm2-shapes"
{
  timeout "$(left 40)" "$PY" -m kvrelay.deploy.cli tiny-model "$SMALL" --layers 30 --hidden 576 --heads 9 --kv-heads 3 \
      --intermediate 1536 --vocab 49152 --weights-dtype bfloat16 \
    && timeout "$(left 70)" "$PY" -m kvrelay.deploy.cli bench cuda-graphs --model "$SMALL" --dtype bfloat16 --device cuda \
      --context 1024 --batch 1,8 --steps 32 --rounds 3
} >"$OUT_DIR/graphs.log" 2>&1
graphs=$?
tail -n 25 "$OUT_DIR/graphs.log"
[ "$graphs" -ne 0 ] && status=$((status == 0 ? 6 : status))

serve=skipped
if [ "$SERVE" = "1" ] && [ $((END - SECONDS)) -ge 180 ]; then
  serve=failed
  MODEL="$WORK/llama-8b-shapes"
  {
    if timeout "$(left 100)" "$PY" -m kvrelay.deploy.cli tiny-model "$MODEL" --layers "$LAYERS" --hidden 4096 --heads 32 \
        --kv-heads 8 --intermediate 14336 --vocab 128256 --weights-dtype bfloat16; then
      cat >"$WORK/gpu.yaml" <<YAML
model: {path: $MODEL, name: llama-8b-shapes, dtype: bfloat16, device: cuda}
kvstore: {block_size_tokens: 16, device: {fraction_of_free: 0.35}, host: {bytes: 4GiB}}
engine: {max_num_seqs: 64, max_num_batched_tokens: 8192}
prefill: {ports: [18100]}
decode: {ports: [18200]}
router: {port: 18000}
YAML
      # the internal token: the router's /health lists its nodes only to a caller holding it (bench serve reads it too)
      export KVRELAY_INTERNAL_TOKEN="${KVRELAY_INTERNAL_TOKEN:-$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')}"
      timeout "$(left 400)" "$PY" -m kvrelay.deploy.cli up --config "$WORK/gpu.yaml" >"$WORK/up.log" 2>&1 &
      up_pid=$!
      # Ready when every node is (both load the 16 GB of weights), the process died, or time ran short;
      # then one short request so that TTFT leaves out Triton's compiles and CUDA's warm-up.
      if "$PY" - "$up_pid" "$((END - SECONDS - 90))" <<'PYWAIT'
import json, os, sys, time, urllib.request
pid, budget = int(sys.argv[1]), float(sys.argv[2])
deadline = time.monotonic() + budget
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("kvrelay up exited before it was ready")
    try:
        health = urllib.request.Request("http://127.0.0.1:18000/health",
                                        headers={"X-Kvrelay-Token": os.environ["KVRELAY_INTERNAL_TOKEN"]})
        with urllib.request.urlopen(health, timeout=2) as r:
            nodes = json.loads(r.read()).get("nodes", {})
        if len(nodes) == 2 and all(n["healthy"] for n in nodes.values()):
            break
    except Exception:
        pass
    time.sleep(1)
else:
    sys.exit("kvrelay up was not ready in time")
body = json.dumps({"model": "llama-8b-shapes", "prompt": [1] * 64, "max_tokens": 2}).encode()
req = urllib.request.Request("http://127.0.0.1:18000/v1/completions", body, {"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=60) as r:
    print("kvrelay up is ready; warm-up request", r.status)
PYWAIT
      then
        timeout "$(left 90)" "$PY" -m kvrelay.deploy.cli bench serve --url http://127.0.0.1:18000 --model "$MODEL" \
          --groups 4 --prompts-per-group 8 --system-tokens 1024 --question-tokens 64 --output-tokens 64 \
          --no-progress --out-dir "$WORK/serve" && serve=ok
      fi
      kill "$up_pid" 2>/dev/null; wait "$up_pid" 2>/dev/null
      echo "--- kvrelay up (last lines)"; tail -n 30 "$WORK/up.log"
    fi
  } >"$OUT_DIR/serve.log" 2>&1
  [ -f "$WORK/serve/summary.json" ] && cp "$WORK/serve/summary.json" "$OUT_DIR/serve.json"
  tail -n 8 "$OUT_DIR/serve.log"
  [ "$serve" != ok ] && status=$((status == 0 ? 5 : status))
  if [ -d "$MODEL" ] && [ $((END - SECONDS)) -ge 60 ]; then
    echo "--- the 8B-shaped model" >>"$OUT_DIR/graphs.log"
    timeout "$(left 80)" "$PY" -m kvrelay.deploy.cli bench cuda-graphs --model "$MODEL" --dtype bfloat16 --device cuda \
      --context 1024 --batch 1 --steps 16 --rounds 2 >>"$OUT_DIR/graphs.log" 2>&1
    tail -n 12 "$OUT_DIR/graphs.log"
  fi
fi
echo "gpu-check: tests exit ${status}, kernel bench exit ${bench}, graphs bench exit ${graphs}, serve ${serve}," \
  "$((SECONDS))s; results in $OUT_DIR"
exit "$status"
