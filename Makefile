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

# Re-install only when the dependency list or the torch spec changes. tools/quiet_torchao.pth:
# on a CPU build of torch, torchao's CUDA extensions fail to load and it says so (and torch
# warns about its Enum registrations) at every import, transformers' included; the venv's
# interpreters leave exactly those lines out (any other warning stays).
$(STAMP): pyproject.toml Makefile tools/quiet_torchao.pth
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[dev,float8]" "$(TORCH_SPEC)"
	$(PY) -c "import shutil, sysconfig; shutil.copy('tools/quiet_torchao.pth', sysconfig.get_paths()['purelib'])"
	echo "$(TORCH_SPEC)" > $(STAMP)

run: $(STAMP)
	$(PY) -m cluster.train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(ARGS)

# One GPU, within 8 minutes: the staged check of benchmarks/gpu_stages.py (env, leak probe,
# tests/gpu on CUDA, the threaded harness over every engine path, ours against torch FSDP2 on
# 125m and 1b), each stage under its own time limit, its result file in gpu-check/ as soon as it
# ends (summary.json last; exit 2 when the python has no CUDA). Needs only torch, numpy, pyarrow,
# safetensors, tokenizers, transformers and pytest: on a bare GPU machine without make, run
# `python3 -m benchmarks.gpu_check --out gpu-check` from the repository root (the README says).
# $(PY) needs torch with CUDA: make setup TORCH_SPEC="torch==2.13.0" TORCH_INDEX=<cu128 URL above>.
# A machine whose own python already has CUDA torch (the lent GPU machines): `make gpu-check
# PY=python3` uses it as it is; PY given on the command line skips the venv setup.
GPU_CHECK_DEPS := $(if $(filter command line,$(origin PY)),,$(STAMP))
GPU_CHECK_OUT ?= gpu-check

gpu-check: $(GPU_CHECK_DEPS)
	$(PY) -m benchmarks.gpu_check --out $(GPU_CHECK_OUT)

# The house rules, kept by ruff (pyproject.toml): line length 100, import order, imports at the
# top unless a comment says why; no import circle in trainer/, cluster/ or benchmarks/
# (tools/import_cycles.py); no file over 450 lines nor class over 250 in trainer/ and cluster/
# (tools/sizes.py). `make format` fixes what can be fixed.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) tools/import_cycles.py
	$(PY) tools/sizes.py

format: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean:
	rm -rf $(VENV) runs outputs multirun data mlflow.db mlartifacts
