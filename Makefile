# Two entry points, both from a fresh clone: `make demo` and `make test`.
# Each makes its own virtualenv in $(VENV) and installs the project into it (not editable).
# TORCH and VISION: the torch and torchvision to install first, from your pip index (TORCH_INDEX, if set, instead):
# on Linux PyPI gives their CUDA builds, which run on a CPU too; `make test TORCH_INDEX=https://download.pytorch.org/whl/cpu`
# gives the CPU ones. torchtune's Llama 3.2 Vision models import torchvision: the vision tests need it.

VENV ?= .venv
TORCH ?= torch==2.14.0
VISION ?= torchvision==0.29.1
TORCH_INDEX ?=
PYTHON ?= python3
BIN := $(abspath $(VENV))/bin

.PHONY: install demo lint test test-fast clean

install:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)" "$(VISION)"
	$(BIN)/python -m pip install -q ".[test,lint]"

demo: install
	$(BIN)/adaptive-batching tiny-assets
	cd /tmp && $(BIN)/tune run adaptive_full_finetune --config tiny_full

# What CI checks before the suite (settings in pyproject.toml): lint rules, the formatter's layout, types.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Two workers, one test file each at a time: a file's shared recipe runs (module fixtures) run once; the longest
# files first, in tests/conftest.py's order; the 15 slowest tests are listed at the end.
test: install
	$(BIN)/pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder --durations=15

# Everything but the end-to-end and multi-process tests, for quick checks while developing.
test-fast: install
	$(BIN)/pytest -q -p no:cacheprovider -m "not e2e and not multiprocess"

clean:
	rm -rf $(VENV) build *.egg-info
