# Two commands do everything on a fresh machine: `make run` and `make test`.
# GPU users: make run TORCH_SPEC="torch==2.13.0" TORCH_INDEX=https://download.pytorch.org/whl/cu128
PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
ARGS        ?=
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed

.PHONY: setup run test test-slow lint format bench clean

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
