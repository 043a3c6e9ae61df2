# kvrelay on CPU: one image for the router, prefill and decode roles (the command picks the role).
#
#   docker build -t kvrelay:cpu .
#   docker run --rm -v "$PWD/.models:/models:ro" -p 8000:8000 kvrelay:cpu \
#       up --host 0.0.0.0 --config /opt/kvrelay/deploy/configs/local.yaml --model /models/smollm2-135m-instruct
#
# The model directory is a volume (weights never go into the image). `--host 0.0.0.0`: the API listens on every
# interface of the container, so the published port reaches it (the default, 127.0.0.1, does not). The nodes bind
# 127.0.0.1 unless the config says otherwise; off loopback they need the internal token (KVRELAY_INTERNAL_TOKEN).
FROM python:3.11-slim-bookworm

# g++: the C++ CPU kernels compile at install, in every ISA variant (setup.py), against the torch installed first.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ iproute2 \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 kvrelay

WORKDIR /opt/kvrelay
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
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu 'torch>=2.4,<=2.14.1' \
 && pip install --no-cache-dir 'setuptools>=77' \
 && pip install --no-cache-dir --no-build-isolation .

USER kvrelay
VOLUME ["/models"]
EXPOSE 8000 8100 8200
ENTRYPOINT ["kvrelay"]
CMD ["--help"]
