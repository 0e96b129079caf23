# skiff scheduler: plain Python, no torch: docker/requirements-scheduler.txt at the versions of
# docker/constraints.txt, then the project itself with --no-deps.
#   docker build -f docker/scheduler.Dockerfile -t skiff-scheduler \
#     --build-arg REVISION="$(git rev-parse HEAD)" .
# PYTHON_IMAGE is an exact version tag; to pin its digest as well, pass
#   --build-arg PYTHON_IMAGE=python:3.11.13-slim-bookworm@sha256:<digest>
# with the digest from `docker buildx imagetools inspect python:3.11.13-slim-bookworm`.
# PYTHON_IMAGE may be any Debian-based image with python (python3-venv on Debian's own python).
# PIP_CONFIG_FILE (optional): a pip configuration file (index, find-links, cert) that every pip
# install reads, e.g. a local index mounted with `buildah bud --volume`.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG PIP_CONFIG_FILE
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CONSTRAINT=/tmp/constraints.txt
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY docker/constraints.txt docker/requirements-scheduler.txt /tmp/
RUN pip install -r /tmp/requirements-scheduler.txt
COPY pyproject.toml README.md /src/
COPY services /src/services
COPY shared /src/shared
COPY kernels /src/kernels
RUN pip install --no-deps /src && pip uninstall --yes pip

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="skiff-scheduler" \
      org.opencontainers.image.description="skiff scheduler: continuous batching and KV-cache placement over NATS" \
      org.opencontainers.image.source="https://github.com/skiff-ai/skiff" \
      org.opencontainers.image.licenses="NOASSERTION" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/skiff skiff
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001:10001
# Prometheus /metrics when started with --metrics-port / SKIFF_METRICS_PORT (the chart: 9090).
EXPOSE 9090
ENTRYPOINT ["skiff", "scheduler"]
