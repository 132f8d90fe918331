# Two commands on a fresh clone: `make demo` and `make test`. Both create .venv and install.
#
# torch: by default `pip install torch==2.13.0`, which on this project's CPU machines resolves
# to the local CPU build. Elsewhere pick the wheel index explicitly, e.g.
#   CPU only:  make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
#   CUDA 12.8: make demo TORCH_INDEX=https://download.pytorch.org/whl/cu128
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
TORCH_INDEX_ARG := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
PYTEST_ARGS ?=

.PHONY: setup test demo proto clean bench

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q $(TORCH_INDEX_ARG) "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# 10 workers, not 4: the example grid has 5 cells (2x2 experts + router), and a cell needs
# two members before anything is averaged; with 4 workers one cell never trains.
DEMO_WORKERS ?= 10
DEMO_DURATION_S ?= 300

demo: setup
	$(PY) -m bagel.worker.demo --run examples/digits-2x2.toml --out demo-out \
		--workers $(DEMO_WORKERS) --duration-s $(DEMO_DURATION_S)

proto: setup
	$(PY) -m bagel.protocol.gen

# Benchmarks print a table and write JSON under bench-out/; never part of `make test`.
bench: setup
	mkdir -p bench-out
	$(PY) bench/compression.py --json bench-out/compression.json
	$(PY) bench/coordinator_load.py --json bench-out/coordinator_load.json
	$(PY) bench/experts_vs_monolith.py --json bench-out/experts_vs_monolith.json
	$(PY) bench/diloco_vs_ddp.py --json bench-out/diloco_vs_ddp.json
	$(PY) -m bagel.sim run sim/scenarios/heterogeneity-10x.toml --out bench-out/sim-het10x

clean:
	rm -rf $(VENV) demo-out .pytest_cache
