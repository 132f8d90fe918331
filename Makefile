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
# Two pytest workers (pytest-xdist): most of the suite waits on real processes and timers, so two
# workers on two cores roughly halve its wall time. The slowest tests are listed after every run,
# so a slow newcomer is seen at once. `make test PYTEST_ARGS=-n0` runs it in one process.
PYTEST_ARGS ?= -n 2 --durations=15

# The pure cores: no I/O, no clock, no sockets, no asyncio, no logging. `make lint` checks them
# with mypy --strict, and tests/test_layering.py checks that this list is its own.
PURE_CORES := coordinator/core/*.py worker/reconciler.py sim/discrete/engine.py models/flow.py \
	compression/base.py compression/blockwise.py compression/floats.py compression/topk.py \
	compression/wire.py compression/feedback.py compression/choice.py
# path -> `-m bagel.<dotted>` (folder coordinator/ is bagel.coordinator; a package's __init__ is the package)
CORE_MODULES = $(foreach f,$(wildcard $(PURE_CORES)),-m bagel.$(subst /,.,$(patsubst %/__init__,%,$(basename $(f)))))
# mypy cannot follow the package-dir mapping through the editable install, so it reads the
# tree through bagel/<pkg> -> <pkg> links (pyproject's [tool.mypy] mypy_path); it reports
# paths under build/typecheck/bagel/.
PACKAGES := coordinator worker protocol compression models robust sim
TYPECHECK_ROOT := build/typecheck/bagel

.PHONY: setup test lint typecheck-root demo proto clean bench netlab netlab-down netlab-deps browser-deps

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q $(TORCH_INDEX_ARG) "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

test: setup lint browser-deps
	@# the network test bed's tests need iproute2 and nftables (installed when missing, as root);
	@# without them those tests skip and name the reason
	@$(MAKE) -s netlab-deps || echo "netlab: the test-bed tests will skip"
	$(PY) -m pytest $(PYTEST_ARGS)

# The dashboard's end-to-end test (tests/test_dashboard.py) opens the page in headless
# Chromium: Debian's `chromium` package, installed here when missing (root and apt-get);
# elsewhere that one test skips and says why.
browser-deps:
	@if ! command -v chromium >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "browser-deps: installing chromium"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
				|| echo "browser-deps: apt-get could not install chromium (the dashboard test will skip)"; \
		else \
			echo "browser-deps: install chromium with your package manager (the dashboard test skips without it)"; \
		fi; \
	fi

# All four checks run (each one's findings are printed) and lint fails if any failed.
lint: setup typecheck-root
	@rc=0; \
	echo "== ruff check"; $(PY) -m ruff check --output-format concise . || rc=1; \
	echo "== ruff format --check"; $(PY) -m ruff format --check --output-format concise . || rc=1; \
	echo "== mypy (the tree and bench/)"; $(PY) -m mypy $(TYPECHECK_ROOT) bench || rc=1; \
	echo "== mypy --strict (the pure cores)"; $(PY) -m mypy --strict --follow-imports=silent $(CORE_MODULES) || rc=1; \
	exit $$rc

typecheck-root:
	@mkdir -p $(TYPECHECK_ROOT)
	@for p in $(PACKAGES); do ln -sfn ../../../$$p $(TYPECHECK_ROOT)/$$p; done

# 10 workers, not 4: the example grid has 5 cells (2x2 experts + router), and a cell needs
# two members before anything is averaged; with 4 workers one cell never trains.
DEMO_WORKERS ?= 10
DEMO_DURATION_S ?= 300
# Keys of the example spec the demo changes (`--set`, space-separated), none by default:
# `make demo DEMO_SET=diloco.overlap=delayed` trains ahead during the exchange. On this
# project's 2-core machine, ten CPU workers have no idle core for that to use, and it
# committed fewer samples (README, "Overlapping the exchange with compute").
DEMO_SET ?=

demo: setup
	$(PY) -m bagel.worker.demo --run examples/digits-2x2.toml --out demo-out \
		--workers $(DEMO_WORKERS) --duration-s $(DEMO_DURATION_S) $(foreach s,$(DEMO_SET),--set $(s))

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

# The network test bed (sim/netlab/): namespaces, NAT routers and shaped links on this machine.
# Needs root, iproute2 and nftables; netlab-deps installs the missing ones with apt-get, or
# says why it cannot. NETLAB_ARGS go to `up` (e.g. --homes 2 --per-home 2 --public 1 --no-shape).
NETLAB_TAG ?= 0
NETLAB_ARGS ?=

netlab-deps:
	@missing=""; \
	command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || missing="$$missing iproute2"; \
	command -v nft >/dev/null 2>&1 || missing="$$missing nftables"; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" != 0 ]; then echo "netlab: needs root to install$$missing (and to build the bed)"; exit 1; fi; \
		if ! command -v apt-get >/dev/null 2>&1; then echo "netlab: install$$missing with your package manager"; exit 1; fi; \
		echo "netlab: installing$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null \
			|| { echo "netlab: apt-get could not install$$missing"; exit 1; }; \
	fi

netlab: setup netlab-deps
	$(PY) -m bagel.sim.netlab up --tag $(NETLAB_TAG) $(NETLAB_ARGS)

netlab-down: setup
	$(PY) -m bagel.sim.netlab down --tag $(NETLAB_TAG)

clean:
	rm -rf $(VENV) demo-out .pytest_cache .mypy_cache .ruff_cache build/typecheck
