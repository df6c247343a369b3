# Every target sets up what it needs, idempotently, into .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.afd-setup-stamp
NIXL_VERSION := 1.5.1

.PHONY: setup proto lint test demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[dev]'
	# NIXL: the CPU wheel plus its meta package, without the CUDA torch they declare.
	$(PIP) install --no-deps nixl-cu12==$(NIXL_VERSION) nixl==$(NIXL_VERSION)
	@touch $(STAMP)

proto: setup
	$(PY) scripts/gen_proto.py

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests

demo: setup
	$(PY) scripts/demo.py

bench: setup
	$(PY) benchmarks/control_hop.py --quick
	$(PY) benchmarks/data_plane.py --quick

clean:
	rm -rf $(VENV) .pytest_cache
