#!/usr/bin/env bash
# Fetch (here, where the package index is reachable) the wheels the GPU machine lacks, into .gpu-wheels/
# (git-ignored): nixl + nixl-cu13 (its torch is a CUDA 13 build), lmdb, and OpenTelemetry's API and SDK (every node
# and the router import them; the image has none), for its Python (3.12 by default).
# The device tool carries the folder with the tree: run(..., carry=[".gpu-wheels"]). About 60 MiB.
#
#   bash scripts/gpu-wheels.sh [PYTHON_VERSION]        # e.g. 3.12 (default)
set -euo pipefail
cd "$(dirname "$0")/.."
PYV="${1:-3.12}"
PIP="${PIP:-.venv/bin/pip}"
rm -rf .gpu-wheels && mkdir -p .gpu-wheels
"$PIP" download --no-deps --only-binary=:all: --python-version "$PYV" --platform manylinux_2_28_x86_64 \
  --implementation cp -d .gpu-wheels nixl==1.5.1 nixl-cu13==1.5.1 lmdb==3.0.0 \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2  # as tested here
du -sh .gpu-wheels && ls .gpu-wheels
