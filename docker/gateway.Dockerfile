# skiff gateway: OpenAI-compatible HTTP API. No torch: only the packages of
# docker/requirements-gateway.txt, then the project itself with --no-deps.
#   docker build -f docker/gateway.Dockerfile -t skiff-gateway .
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY docker/requirements-gateway.txt /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt
COPY pyproject.toml README.md /src/
COPY services /src/services
COPY shared /src/shared
COPY kernels /src/kernels
RUN pip install --no-deps /src

FROM ${PYTHON_IMAGE}
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/skiff skiff \
    && install -d -o 10001 -g 10001 /cache
COPY --from=build /opt/venv /opt/venv
# XDG_CACHE_HOME: the default model's tokenizer is looked up in /cache/skiff/models/...
# (the chart mounts a writable volume there; the root filesystem can stay read-only).
# SKIFF_HOST: a container listens on every interface (`skiff gateway` alone binds 127.0.0.1).
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    XDG_CACHE_HOME=/cache TOKENIZERS_PARALLELISM=false SKIFF_HOST=0.0.0.0
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["skiff", "gateway"]
