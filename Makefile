# Two commands set everything up on a fresh machine: `make test` and `make lab`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
export OMP_NUM_THREADS ?= 2

.PHONY: test test-kernels lab demo bench lint notebooks clean venv

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Re-install only when the project's metadata changes.
$(VENV)/.stamp-dev: pyproject.toml | $(VENV)/bin/activate
	$(PIP) install -q -e ".[cpu,dev]"
	touch $@

$(VENV)/.stamp-lab: pyproject.toml | $(VENV)/.stamp-dev
	$(PIP) install -q -e ".[cpu,dev,lab]"
	touch $@

venv: $(VENV)/.stamp-dev

# Two worker processes, each taking whole test files (a file's fixtures are built once): most tests
# keep one core busy, so two of them halve the time on a 2-core machine. One OpenMP thread each (and
# in the kernels and ranks they start): threads that outnumber the cores spin against each other,
# which made the suite a third slower.
test: $(VENV)/.stamp-dev
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile tests

# The Triton kernel tests under Triton's CPU interpreter, in a venv of their own (torch's CPU
# wheel + Triton 3.6, whose interpreter needs numpy < 2.3; about 1 GB; not in `make test`).
KVENV := .venv-kernels
$(KVENV)/.stamp:
	$(PYTHON) -m venv $(KVENV)
	$(KVENV)/bin/python -m pip install -q "torch==2.13.0" "triton==3.6.0" "numpy<2.3" pytest matplotlib
	touch $@

test-kernels: $(KVENV)/.stamp
	TRITON_INTERPRET=1 PYTHONPATH=. $(KVENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py

# Jupyter refuses to start as root unless told; containers often run as root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: $(VENV)/.stamp-lab
	$(VENV)/bin/jupyter lab $(ROOT_FLAG) notebooks/

demo: $(VENV)/.stamp-dev
	$(PY) -m fleetlab demo

# One thread: how README's figures were measured (two threads wait on each other on 2 cores).
bench: $(VENV)/.stamp-dev
	OMP_NUM_THREADS=1 $(PY) -m fleetlab bench

lint: $(VENV)/.stamp-dev
	$(VENV)/bin/ruff check fleetlab tests tools notebooks
	$(PY) tools/notebooks.py check

# After editing a notebook (in JupyterLab or as its .py): bring each .ipynb/.py pair in step, strip outputs.
notebooks: $(VENV)/.stamp-dev
	$(PY) tools/notebooks.py sync

clean:
	rm -rf $(VENV) $(KVENV) .pytest_cache .hypothesis build *.egg-info
