# duelq server image:  docker build -t duelq . && docker run --gpus all -p 50051:50051 duelq
#
# A CUDA runtime image is not enough for CuPy on CUDA 12.2+: NVRTC needs the cudart
# headers to compile kernels/*.cu at start-up, so the cudart dev package is added; and gcc
# builds server/core/native.c (a step's host calls in C) at the first start.
ARG BASE_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

ARG CUDA_PKG=12-6
# The base image's tag pins the distribution and the CUDA release; its apt versions follow.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 python3-venv "cuda-cudart-dev-${CUDA_PKG}" gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/duelq \
    PATH=/opt/duelq/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/duelq

# Dependencies first (cached while only the sources change): read them from pyproject,
# the client's and the server and cuda extras'.
WORKDIR /src
COPY pyproject.toml ./
RUN python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
x = p['optional-dependencies']; print('\n'.join(p['dependencies'] + x['server'] + x['cuda']))" \
    > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt

COPY README.md ./
COPY protos ./protos
COPY kernels ./kernels
COPY wire ./wire
COPY client ./client
COPY server ./server
COPY apps ./apps
# Our own package, dependencies already installed above.
# hadolint ignore=DL3013
RUN pip install --no-deps .

# A non-root user with its own CuPy kernel cache and checkpoint directory.
RUN useradd --create-home --uid 10001 duelq \
 && mkdir -p /data/checkpoints /home/duelq/.cache/cupy \
 && chown -R duelq:duelq /data /home/duelq/.cache
USER 10001
WORKDIR /home/duelq
# Eight gRPC front processes relay to the learner process (on 16-core H200 hosts 8 fronts
# carried more steps/s than 4 at B = 1024); hosts with fewer cores:
# -e DUELQ_FRONT_PROCESSES=<about half the cores>.
ENV CUPY_CACHE_DIR=/home/duelq/.cache/cupy \
    DUELQ_FRONT_PROCESSES=8 \
    DUELQ_HOST=0.0.0.0 \
    DUELQ_PORT=50051 \
    DUELQ_METRICS_PORT=9090 \
    DUELQ_CHECKPOINT_DIR=/data/checkpoints
VOLUME ["/data/checkpoints"]
EXPOSE 50051 9090

# Probes localhost:$DUELQ_PORT.  With TLS it also reads DUELQ_TLS_CA (and
# DUELQ_TLS_SERVER_NAME when the certificate does not name localhost); with mTLS,
# DUELQ_TLS_CLIENT_CERT and DUELQ_TLS_CLIENT_KEY (see the README).
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
  CMD ["duelq", "health"]

# Exec form: SIGTERM reaches the server, which drains, checkpoints and exits.
ENTRYPOINT ["duelq", "serve"]
