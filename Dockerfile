# syntax=docker/dockerfile:1
# One image for both `fleetgate operator` and `fleetgate router` (target
# `runtime`, the default), and the engine emulator image (target `emulator`):
# the same package with `vllm`, `trtllm-serve` and `python3 -m
# vllm.entrypoints.openai.api_server` answering with `fleetgate sim`.
#
# BASE: any Debian bookworm image with Python 3.11 and the venv module. Users
# keep the default; hack/build-image.sh passes a debootstrapped base when no
# registry is reachable. CA_BUNDLE: a CA file that pip should trust (mounted
# read-only by hack/build-image.sh for TLS-intercepting networks); unset = pip's own.
ARG BASE=python:3.11-slim-bookworm

# Build stage: a venv at /opt/fleetgate holding fleetgate and its dependencies
# (dependency layer first, so a source change does not re-download them). Left
# out of it: pip and setuptools, and the kubernetes client's asyncio twin
# (kubernetes/aio, 68 MB) that fleetgate never imports.
FROM ${BASE} AS build
ARG CA_BUNDLE=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# 1) dependencies only: pyproject.toml changes rarely
COPY pyproject.toml README.md ./
RUN if [ -n "$CA_BUNDLE" ]; then export PIP_CERT="$CA_BUNDLE"; fi \
 && python3 -m venv /opt/fleetgate \
 && mkdir -p fleetgate && touch fleetgate/__init__.py \
 && /opt/fleetgate/bin/pip install -q . \
 && /opt/fleetgate/bin/pip uninstall -q -y fleetgate \
 && rm -rf build fleetgate.egg-info
# 2) the package itself (only fleetgate/: never tests, tools or docs)
COPY fleetgate ./fleetgate
RUN if [ -n "$CA_BUNDLE" ]; then export PIP_CERT="$CA_BUNDLE"; fi \
 && /opt/fleetgate/bin/pip install -q --no-deps . \
 && /opt/fleetgate/bin/pip check \
 && /opt/fleetgate/bin/pip uninstall -q -y pip setuptools \
 && rm -rf /opt/fleetgate/lib/python3.11/site-packages/kubernetes/aio \
 && find /opt/fleetgate -name '__pycache__' -prune -exec rm -rf {} + \
 && /opt/fleetgate/bin/python -m compileall -q -j 0 /opt/fleetgate/lib

# Runtime: the base plus the venv; no pip, no compilers; non-root.
FROM ${BASE} AS runtime
ENV PATH=/opt/fleetgate/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN groupadd --system --gid 65532 fleetgate \
 && useradd --system --uid 65532 --gid fleetgate --home-dir /nonexistent --shell /usr/sbin/nologin fleetgate
COPY --from=build /opt/fleetgate /opt/fleetgate
USER 65532:65532
EXPOSE 8080 9090
# exec form: fleetgate is PID 1 and handles SIGTERM itself (router: drain then exit 0)
ENTRYPOINT ["fleetgate"]
CMD ["router", "--help"]

# The engine emulator: the operator's engine command lines run `fleetgate sim`.
# Use it as `engine.image` in an InferenceService to try fleetgate without GPUs.
FROM runtime AS emulator
USER 0:0
COPY images/emulator/bin/ /usr/local/bin/
COPY images/emulator/site-packages/ /opt/fleetgate/lib/python3.11/site-packages/
RUN chmod 0755 /usr/local/bin/vllm /usr/local/bin/trtllm-serve \
 && /opt/fleetgate/bin/python -c "import vllm.entrypoints.openai.api_server"
USER 65532:65532
EXPOSE 8000
ENTRYPOINT []
CMD ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--host", "0.0.0.0", "--port", "8000"]

# the default target stays the operator/router image
FROM runtime
