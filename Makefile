# Every target creates/reuses .venv and installs what it needs, so each works on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The development pair (pyproject.toml allows any torch >= the floor; this is the one `make venv` installs).
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
STAMP := $(VENV)/.installed
# The floor pair: the oldest torch pyproject.toml admits, and the tests that touch the APIs it must have
# (FSDP2 matrix and mixed precision, DCP save/resume, export and load of every format).
FLOOR_VENV ?= .venv-floor
FLOOR_PINS := torch==2.9.1 torchvision==0.24.1
FLOOR_STAMP := $(FLOOR_VENV)/.installed
FLOOR_TESTS := tests/train/test_fsdp_matrix.py tests/train/test_mixed_precision.py tests/train/test_pretrain_resume.py \
	tests/train/test_checkpoint_manager.py tests/test_hub.py tests/test_hub_dinov3.py tests/test_export_hf.py \
	tests/test_export_onnx.py tests/test_export_roundtrip.py tests/utils/test_torch_compat.py \
	tests/ssl/test_adamw_local.py

.PHONY: venv venv-floor test test-floor test-fast bench curation-tables quickstart gpu-check gpu-bench gpu-proxy official-src gpu-bench-wheels gpu-proxy-compiled clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PINS)
	$(BIN)/python -m pip install -q -e '.[cpu,dev]'
	touch $(STAMP)

# Two sessions: the memory measurements (marker `memory`) in one of their own, so no heap or state left by the
# rest of the suite moves their bounds.
test: venv
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -m "not memory" tests
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -m memory tests

# The floor subset on the oldest supported torch (a second virtualenv; .ci/run calls it after `make test`).
venv-floor: $(FLOOR_STAMP)

$(FLOOR_STAMP): pyproject.toml Makefile
	test -x $(FLOOR_VENV)/bin/python || $(PY) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q --upgrade pip
	$(FLOOR_VENV)/bin/python -m pip install -q $(FLOOR_PINS)
	$(FLOOR_VENV)/bin/python -m pip install -q -e '.[cpu,dev]'
	$(FLOOR_VENV)/bin/python -c "import torch, torchvision; assert torch.__version__.startswith('2.9.1'), torch.__version__"
	touch $(FLOOR_STAMP)

test-floor: venv-floor
	OMP_WAIT_POLICY=PASSIVE $(FLOOR_VENV)/bin/python -m pytest -q -p no:cacheprovider $(FLOOR_TESTS)

test-fast: venv
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -m "not slow" tests

# Sample pool from photos shipped in pip packages -> curate -> pretrain -> distill -> kNN eval -> report (CPU).
quickstart: venv
	OMP_WAIT_POLICY=PASSIVE $(BIN)/dinopipe pipeline --config configs/pipeline/quickstart.yaml

# One-command GPU acceptance check (JSON report in gpu-check/report.json; non-zero exit on any failure).
# No venv: it runs with whatever python has torch + timm (a GPU node's own), e.g. make gpu-check PY=python3;
# GPU_CHECK_ARGS=--cpu runs the CPU smoke subset.
gpu-check:
	OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$(CURDIR):$$PYTHONPATH $(PY) -m dinopipe.app.gpu_check --out gpu-check $(GPU_CHECK_ARGS)

# dinopipe's training step vs the official DINOv2 step on one GPU (bench/gpu_bench.py; JSON in gpu-bench/).
# No venv, as gpu-check: make gpu-bench PY=python3. Needs `make official-src` (the official source, never
# vendored, into .official/dinov2) and, where omegaconf/fvcore are missing, `make gpu-bench-wheels` (.whl/),
# both carried to an offline GPU machine; GPU_BENCH_ARGS=--cpu runs the CPU smoke.
OFFICIAL_SRC ?= https://github.com/facebookresearch/dinov2
gpu-bench:
	OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$(CURDIR):$$PYTHONPATH $(PY) bench/gpu_bench.py --out gpu-bench $(GPU_BENCH_ARGS)

# dinopipe's step and the official one, their GPU cost estimated on this CPU (bench/gpu_proxy.py: fake tensors, datasheet
# rooflines, an estimate; never fitted to the GPU runs of docs/gpu.md); JSON in bench/results/gpu_proxy.json, tables in docs/gpu.md
# and README.md. Needs `make official-src`.
gpu-proxy: venv
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python bench/gpu_proxy.py
	$(BIN)/python bench/gpu_proxy.py --render

# the compiled steps (inductor's Triton kernels for a pretend Hopper GPU, generated on this CPU, costed per kernel);
# JSON in bench/results/gpu_proxy_compiled.json. Needs `make official-src` and triton (the torch wheel's).
gpu-proxy-compiled: venv
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python bench/gpu_proxy_compiled.py

# Also dinov3 (.official/dinov3: its depth metrics, run by tests/eval/test_depth_metrics.py); offline, give a local
# git dir: make official-src OFFICIAL_SRC=/path/dinov2.git OFFICIAL_SRC_V3=/path/dinov3.git
OFFICIAL_SRC_V3 ?= https://github.com/facebookresearch/dinov3
official-src:
	bench/tools/fetch_official.sh $(OFFICIAL_SRC) .official/dinov2
	PATHS="dinov3 LICENSE.md" bench/tools/fetch_official.sh $(OFFICIAL_SRC_V3) .official/dinov3

gpu-bench-wheels:
	PYTHON=$(PY) bench/tools/gpu_bench_wheels.sh .whl

bench: venv
	$(BIN)/python bench/tools/run_all.py

# curation/plan_rates.json and the curation tables of docs/curation-scale.md and docs/benchmarks.md, from the growth bench's JSON
# (bench/bench_curation_scale.py --json; several files: SCALE_JSON="a.json b.json"); VERIFY_JSON: bench_verify --json.
# RATES_JSON: the runs the planner's rates are taken from (and checked against): 384-d runs with a whole search,
# since the plan has no per-dimension rate; SCALE_JSON: the growth table (the 10M run is 128-d, 1% of rows queried).
SCALE_JSON ?= bench/results/scale_10m_d128.json
RATES_JSON ?= bench/results/scale_1m.json bench/results/scale_3m.json
# TASKS_JSON: runs at W = 1 and W = 4 (at the largest N; a smaller N at W = 4 shows a per-task constant), the
# per-task memory table (docs/curation-scale.md).
TASKS_JSON ?= bench/results/scale_10m_d128.json
# CHAIN_JSON: runs of `curate run`'s default config (write and report included; docs region default-chain-table).
CHAIN_JSON ?= bench/results/scale_default_chain.json bench/results/scale_default_chain_3m.json
# CHAIN_LARGE_JSON: the default config at 1M and 10M rows, 128-d, 1% of rows querying (docs region default-chain-large-table).
CHAIN_LARGE_JSON ?= bench/results/scale_default_chain_10m.json
VERIFY_JSON ?=
curation-tables: venv
	$(BIN)/python bench/tools/rates_from_bench.py --scale $(RATES_JSON) $(if $(VERIFY_JSON),--verify $(VERIFY_JSON)) --out curation/plan_rates.json
	$(BIN)/python bench/tools/render_tables.py --scale $(SCALE_JSON) --rates curation/plan_rates.json --check $(RATES_JSON) \
		$(if $(TASKS_JSON),--tasks-memory $(TASKS_JSON)) $(if $(CHAIN_JSON),--default-chain $(CHAIN_JSON)) \
		$(if $(CHAIN_LARGE_JSON),--default-chain-large $(CHAIN_LARGE_JSON))

clean:
	rm -rf $(VENV) $(FLOOR_VENV) .pytest_cache
