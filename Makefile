# Set-up and everyday commands. Each target installs what it needs, so they work on a fresh machine.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
PYTEST_WORKERS ?= 2
TORCH_CPU_VERSION ?= 2.13.0

.PHONY: install torch test test-slow test-distributed test-vllm demo bench lint format clean

# Install the CPU build of torch only when no torch is present (a plain `torch` requirement would pull CUDA wheels).
torch:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "torch==$(TORCH_CPU_VERSION)"

install: torch
	@$(PYTHON) -c "import trl, pytest, hypothesis, xdist, ruff, wandb" 2>/dev/null && $(PYTHON) -c "import importlib.metadata as m; m.version('trl')" >/dev/null 2>&1 \
		|| $(PIP) install -q -e ".[test,quality]"

test: install
	$(PYTHON) -m pytest -m "not slow and not distributed and not vllm" -n $(PYTEST_WORKERS) --dist loadgroup -q -p no:cacheprovider tests

test-slow: install
	$(PYTHON) -m pytest -m "slow" -q tests

test-distributed: install
	$(PYTHON) -m pytest -m "distributed" -q tests

test-vllm: install
	$(PYTHON) -m pytest -m "vllm" -q tests

demo: install
	$(PYTHON) -m trl.demo

bench: install
	$(PYTHON) benchmarks/run_all.py

lint: install
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .

format: install
	$(PYTHON) -m ruff check --fix . && $(PYTHON) -m ruff format .

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
