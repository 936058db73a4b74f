# Two commands do everything on a fresh machine: `make run` and `make test`.
# GPU users: make run TORCH_SPEC="torch==2.13.0" TORCH_INDEX=https://download.pytorch.org/whl/cu128
PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
ARGS        ?=
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed

.PHONY: setup run test test-slow gpu-check lint format bench clean

setup: $(STAMP)

# Re-install only when the dependency list or the torch spec changes.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[dev]" "$(TORCH_SPEC)"
	echo "$(TORCH_SPEC)" > $(STAMP)

run: $(STAMP)
	$(PY) -m cluster.train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(ARGS)

# One GPU, under 6 minutes: the GPU tests (NCCL at world size 1; world sizes 2-4 as threads on the
# one device), then our engine against torch FSDP2 on 125m and 1b in bf16 (benchmarks/gpu_check.py:
# tokens/s, MFU, peak memory against the planner, exposed communication; last line JSON).
# $(PY) needs torch with CUDA: make setup TORCH_SPEC="torch==2.13.0" TORCH_INDEX=<cu128 URL above>.
# A machine whose own python already has CUDA torch and no network to build the venv (the lent
# GPU machines): `make gpu-check PY=python3` uses it as it is; PY given on the command line skips
# the venv setup, so nothing is installed.
GPU_CHECK_DEPS := $(if $(filter command line,$(origin PY)),,$(STAMP))
CUDA_HINT := install the CUDA build (make setup TORCH_SPEC="torch==2.13.0" \
	TORCH_INDEX=https://download.pytorch.org/whl/cu128) or name a python that has one \
	(make gpu-check PY=python3)

gpu-check: $(GPU_CHECK_DEPS)
	@$(PY) -c "import sys, torch; ok = torch.cuda.is_available(); \
		print(f'gpu-check: {sys.executable}: torch {torch.__version__}, ' \
		      f'CUDA {torch.version.cuda}, GPU visible: {ok}'); sys.exit(0 if ok else 1)" \
		|| { echo 'gpu-check: no usable CUDA torch in $(PY): $(CUDA_HINT)' >&2; exit 1; }
	$(PY) -m pytest -q tests/gpu
	$(PY) -m benchmarks.gpu_check

# The house rules, kept by ruff (pyproject.toml): line length 100, import order, imports at the
# top unless a comment says why. `make format` fixes what can be fixed.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean:
	rm -rf $(VENV) runs outputs multirun data mlflow.db mlartifacts
