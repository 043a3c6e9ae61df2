# kvrelay on CPU: one image for the router, prefill and decode roles (the command picks the role).
#
#   docker build -t kvrelay:cpu .
#   docker run --rm -v "$PWD/.models:/models:ro" -p 8000:8000 kvrelay:cpu \
#       up --config /opt/kvrelay/deploy/configs/local.yaml --model /models/smollm2-135m-instruct
#
# The model directory is a volume (weights never go into the image). The nodes bind 127.0.0.1 unless
# the config says otherwise; off loopback they need the internal token (KVRELAY_INTERNAL_TOKEN).
FROM python:3.11-slim-bookworm

# g++: the CPU attention kernel is a torch C++ extension compiled on first use.
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
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu .

USER kvrelay
VOLUME ["/models"]
EXPOSE 8000 8100 8200
ENTRYPOINT ["kvrelay"]
CMD ["--help"]
