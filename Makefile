# Every target creates/reuses .venv and installs what it needs, so each works on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch/torchvision come from the machine's local disk (pip's find-links); the rest from the registry.
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast bench quickstart gpu-check clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PINS)
	$(BIN)/python -m pip install -q -e '.[cpu,dev]'
	touch $(STAMP)

test: venv
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q tests

test-fast: venv
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -m "not slow" tests

# Sample pool from photos shipped in pip packages -> curate -> pretrain -> distill -> kNN eval -> report (CPU).
quickstart: venv
	OMP_WAIT_POLICY=PASSIVE $(BIN)/dinopipe pipeline --config configs/pipeline/quickstart.yaml

# One-command GPU acceptance check (JSON report in gpu-check/report.json; non-zero exit on any failure).
# No venv: it runs with whatever python has torch + timm (a GPU node's own), e.g. make gpu-check PY=python3;
# GPU_CHECK_ARGS=--cpu runs the CPU smoke subset.
gpu-check:
	OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$(CURDIR):$$PYTHONPATH $(PY) -m dinopipe.gpu_check --out gpu-check $(GPU_CHECK_ARGS)

bench: venv
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache
