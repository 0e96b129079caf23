# skiff scheduler: plain Python, no torch: only docker/requirements-scheduler.txt, then the
# project itself with --no-deps.
#   docker build -f docker/scheduler.Dockerfile -t skiff-scheduler .
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY docker/requirements-scheduler.txt /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt
COPY pyproject.toml README.md /src/
COPY services /src/services
COPY shared /src/shared
COPY kernels /src/kernels
RUN pip install --no-deps /src

FROM ${PYTHON_IMAGE}
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/skiff skiff
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001:10001
# Prometheus /metrics when started with --metrics-port / SKIFF_METRICS_PORT (the chart: 9090).
EXPOSE 9090
ENTRYPOINT ["skiff", "scheduler"]
