# Two entry points for a fresh machine with only Python 3.11:
#   make demo   -- create .venv, install torch 2.13.0 (CPU) and the toolkit, run the end-to-end demo
#   make test   -- create .venv, install with dev extras, run ruff, mypy and pytest (every test)
#   make test-fast -- the same without the tests marked slow (multi-process, browser): under 2 minutes
#   make docs-report -- regenerate docs/report.png and docs/report.json from the demo (needs chromium)
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# pytest-xdist workers: one per core, at most 4 (tests start gloo process groups of up to 8 ranks)
PYTEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0))))")
# One intra-op thread per test process: the workers already fill the cores, and OpenMP threads
# spinning on an oversubscribed host made single tests 5-7x slower (a finetune test: 19 s alone,
# 144 s beside another worker). Subprocesses (torchrun ranks, benchmarks) inherit it.
PYTEST_ENV = HF_HUB_OFFLINE=1 OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1}

.PHONY: setup demo docs-report test test-gpu lint typecheck pytest clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,lm-eval,megatron]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	HF_HUB_OFFLINE=1 $(PY) -m tools.demo

# docs/report.png (+ docs/report.json, the numbers it shows) from a fresh demo; needs chromium
docs-report: setup
	HF_HUB_OFFLINE=1 $(PY) -m tools.docs_report --out docs

lint: setup
	$(VENV)/bin/ruff check pretrain mlm_eval finetune tools tests benchmarks
	$(VENV)/bin/ruff format --check pretrain mlm_eval finetune tools tests benchmarks

typecheck: setup
	$(VENV)/bin/mypy

pytest: setup
	$(PYTEST_ENV) $(PY) -m pytest -p no:cacheprovider -rs -n $(PYTEST_WORKERS) --durations=30 tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

pytest-fast: setup
	$(PYTEST_ENV) $(PY) -m pytest -p no:cacheprovider -rs -n $(PYTEST_WORKERS) -m "not slow" tests

test: lint typecheck pytest

test-fast: lint typecheck pytest-fast

# CUDA/NCCL lane: TP/PP/DP equivalence under NCCL, bf16/fp16, distributed optimizer (skipped without CUDA).
test-gpu: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -p no:cacheprovider -rs -m gpu tests

clean:
	rm -rf $(VENV) build *.egg-info
