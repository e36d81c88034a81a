# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Both depend on `make setup` and `make engine`, which are idempotent.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done

.PHONY: setup compile engine demo test lint typecheck layering rules unit bus systemd engines bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup-system.sh
	bash scripts/setup-system.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,engines]'
	touch $(STAMP)

# llama.cpp's llama-server, built once from the pinned sdist (uapplace/sim/llama-cpp.pin)
# and cached outside the repository; a cached binary that runs is reused at once. The
# first build takes minutes and prints its progress (docs/architecture.md, "Test tiers").
engine: setup
	bash scripts/build-llama-server.sh

# The package's bytecode written ahead (only what changed is compiled again): a command
# then starts without compiling uapplace, also where PYTHONDONTWRITEBYTECODE is set
# (docs/performance.md, "The light CLI on click").
compile: setup
	$(BIN)/python -m compileall -q uapplace

demo: setup engine compile
	$(BIN)/uapplace demo

lint: setup
	$(BIN)/ruff format --check uapplace tests bench
	$(BIN)/ruff check uapplace tests bench

# mypy strict on uapplace/, tests/ and bench/ (files = in pyproject's [tool.mypy]).
typecheck: setup
	$(BIN)/mypy

# The import contracts in pyproject's [tool.importlinter] (docs/architecture.md,
# "Layers"). No cache: the graph takes well under a second.
layering: setup
	$(BIN)/lint-imports --no-cache

# The shipped Prometheus rules: syntax and their promtool unit tests
# (contrib/prometheus/README.md). `make test` runs the same through
# tests/unit/test_prometheus_rules.py.
rules: setup
	cd contrib/prometheus && promtool check rules uapplace.rules.yml && promtool test rules tests/*.yml

test: lint typecheck layering engine
	$(BIN)/pytest

unit: setup
	$(BIN)/pytest tests/unit

bus: setup
	$(BIN)/pytest tests/bus

systemd: setup
	$(BIN)/pytest tests/systemd

engines: setup engine
	$(BIN)/pytest tests/engines

bench: setup compile
	$(BIN)/python bench/bench_admission.py
	$(BIN)/python bench/bench_bus.py
	$(BIN)/python bench/bench_shim.py
	$(BIN)/python bench/bench_gate.py
	$(BIN)/python bench/bench_sse_admit.py
	$(BIN)/python bench/bench_swap.py
	$(BIN)/python bench/flood_rss.py
	$(BIN)/python bench/bench_burst.py
	$(BIN)/python bench/bench_swap.py --pause
	$(BIN)/python bench/bench_envelope.py
	$(BIN)/python bench/chaos.py --steps 300

clean:
	rm -rf $(VENV) *.egg-info .mypy_cache .ruff_cache .pytest_cache
