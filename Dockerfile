# syntax=docker/dockerfile:1
# One image for every Tenplex component. The entry point is the `tenplex` CLI:
#   scheduler:  tenplex scheduler serve --backend kubernetes --host 0.0.0.0 --port 8080
#   store:      tenplex store serve --root /var/lib/tenplex/store --host 0.0.0.0 --port 7070
#   workers:    the ElasticJob's own command (e.g. python -m examples.gpt.train), which replaces the entry point.
#
# CPU PyTorch by default; for NVIDIA GPUs build with a CUDA wheel variant, e.g.
#   docker build --build-arg TORCH_VARIANT=cu128 -t tenplex:0.1.0-cu128 .
# (the CUDA runtime comes inside the torch wheels; the node's driver comes from the NVIDIA container toolkit).

# Pinned by tag and by the digest of its multi-architecture index.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d

# ---------------------------------------------------------------- builder: a self-contained venv
FROM ${PYTHON_IMAGE} AS builder

ARG TORCH_VERSION=2.13.0
# cpu, or a CUDA variant of the PyTorch wheel index (cu126, cu128, ...).
ARG TORCH_VARIANT=cpu

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH

RUN python -m venv /opt/venv

# PyTorch first, in its own layer: the largest one, rebuilt only when its version or variant changes.
# hadolint ignore=DL3059
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY tenplex ./tenplex
COPY examples ./examples
# torch==2.13.0 is already satisfied by the wheel above, so pip does not fetch another build. The example
# jobs are their own distribution (tenplex-examples), registering their layout providers by entry points.
# The `clients` extra and torchtitan + torchdata (without their declared dependencies, as the Makefile installs
# them: their metadata pulls another torch) are what the `torchtitan` and `transformers` layout providers and
# trainer integrations import: the scheduler derives those jobs' layouts, their workers run the trainers.
# (DL3013 takes ".[clients]" for an unpinned package: it is this source tree, every requirement pinned in it.)
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[clients]" ./examples \
    && pip install --no-cache-dir --no-deps torchtitan==0.3.0 torchdata==0.11.0 \
    && python -c "import tenplex.cli, examples.gpt.train, tenplex.integrations.torchtitan.layout, tenplex.integrations.transformers.layout"

# ---------------------------------------------------------------- runtime: slim, non-root
FROM ${PYTHON_IMAGE} AS runtime

ARG UID=10001
ARG GID=10001

LABEL org.opencontainers.image.title="tenplex" \
      org.opencontainers.image.description="Elastic multi-dimensional-parallel PyTorch training: scheduler, tensor store and workers" \
      org.opencontainers.image.licenses="Apache-2.0"

RUN groupadd --system --gid "${GID}" tenplex \
    && useradd --system --uid "${UID}" --gid "${GID}" --home-dir /home/tenplex --create-home --shell /usr/sbin/nologin tenplex \
    && mkdir -p /var/lib/tenplex/store \
    && chown "${UID}:${GID}" /var/lib/tenplex/store

COPY --from=builder /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/tenplex

USER ${UID}:${GID}
WORKDIR /home/tenplex

# 8080: scheduler REST API; 7070: store daemon. Both serve /healthz (no auth) and /metrics.
EXPOSE 8080 7070

ENTRYPOINT ["tenplex"]
CMD ["--help"]
