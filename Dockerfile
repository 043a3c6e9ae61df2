# kvrelay on CPU: one image for the router, prefill and decode roles (the command picks the role).
#
#   bash scripts/container-base.sh              # the base, kvrelay-base:bookworm, from a debootstrap root
#   podman build -t kvrelay:cpu .               # or: --build-arg BASE=debian:bookworm-slim where a registry is near
#   podman run --rm -v "$PWD/.models:/models:ro" -p 18000:8000 kvrelay:cpu \
#       up --host 0.0.0.0 --model /models/smollm2-135m-instruct
#
# `make container-check` builds both and serves a chat request from them (docs/operations/containers.md).
# The model directory is a volume (weights never go into the image), readable by uid 10001. `--host 0.0.0.0`: the API
# listens on every interface of the container, so the published port reaches it (the default, 127.0.0.1, does not).
# The nodes bind 127.0.0.1 unless the config says otherwise; off loopback they need the internal token
# (KVRELAY_INTERNAL_TOKEN). The config files of deploy/configs/ are in the image; the default is local.yaml.
ARG BASE=kvrelay-base:bookworm

# ---- build: the compiler and Python's headers stay in this stage
FROM ${BASE} AS build
# g++ and python3-dev: the C++ CPU kernels compile at install against the torch installed first (setup.py).
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ python3-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch's CPU build (the default index's torch is the CUDA one, with ~3 GB of CUDA libraries). TORCH_INDEX= (empty):
# pip's own configuration supplies it (a find-links directory mounted into the build).
ARG TORCH=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "$TORCH" 'setuptools>=77' ninja

WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvrelay/ kvrelay/
COPY kernels/ kernels/
COPY model/ model/
COPY kvstore/ kvstore/
COPY transfer/ transfer/
COPY engine/ engine/
COPY node/ node/
COPY prefill/ prefill/
COPY decode/ decode/
COPY router/ router/
COPY deploy/ deploy/
COPY benchmarks/ benchmarks/
COPY setup.py ./
# Every instruction-set variant of the kernels (the image runs on CPUs other than the builder's), so no container
# compiles at start; no build isolation: they build against the torch above.
ARG KVRELAY_BUILD_VARIANTS=all
RUN KVRELAY_BUILD_VARIANTS="$KVRELAY_BUILD_VARIANTS" pip install --no-cache-dir --no-build-isolation .

# ---- the image: the Debian root, the venv, a user
FROM ${BASE}
RUN useradd --create-home --uid 10001 kvrelay
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
USER kvrelay
# Relative paths of the configs (the disk tier's .kvrelay/disk) land in the user's home, which it may write.
WORKDIR /home/kvrelay
VOLUME ["/models"]
EXPOSE 8000 8100 8200
ENTRYPOINT ["kvrelay"]
CMD ["--help"]
