# syntax=docker/dockerfile:1
# One image for both `fleetgate operator` and `fleetgate router`.
# Build stage: resolve and build wheels (dependency layer first, so a source
# change does not re-download dependencies). Runtime stage: slim Python, no
# compilers or pip caches, non-root user.
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# 1) dependencies only: pyproject.toml changes rarely
COPY pyproject.toml README.md ./
RUN mkdir -p fleetgate && touch fleetgate/__init__.py \
 && pip wheel --wheel-dir /wheels .
# 2) the package itself
COPY fleetgate ./fleetgate
RUN rm -f /wheels/fleetgate-*.whl && pip wheel --no-deps --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --system --gid 65532 fleetgate \
 && useradd --system --uid 65532 --gid fleetgate --home-dir /nonexistent --shell /usr/sbin/nologin fleetgate
COPY --from=build /wheels /wheels
RUN pip install --no-index --find-links=/wheels fleetgate==0.1.0 && rm -rf /wheels
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["fleetgate"]
CMD ["router", "--help"]
