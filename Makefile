# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create (or reuse) a virtualenv in .venv and install what they need.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch is pinned: on these CPU machines torch 2.13.0 lies on disk; anything unpinned pulls CUDA wheels.
TORCH  ?= torch==2.13.0

.PHONY: demo test venv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]" "$(TORCH)"
	touch $@

venv: $(VENV)/.installed

# Two workers: the suite waits on child processes, daemons and timeouts about half its time (109 %
# of 2 cores, measured); tests/conftest.py keeps each file on one worker and the Slurm files together.
test: venv
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

demo: venv
	$(PY) -m llamarl.pipeline.demo

clean:
	rm -rf $(VENV) demo-run
