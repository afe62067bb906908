# mindpulse: `make demo` runs the default job, `make test` runs every test.
# Both create .venv and install on a fresh machine; a second run skips the install.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo lint test test-quick bench bench-rules compat pretrain clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "mindpulse needs Python 3.11 (mindspore 2.9 wheels)"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# the package with the framework pair the demo and the tests run (the `mindspore` extra)
	$(BIN)/python -m pip install --quiet -e ".[mindspore,test]"
	# coverage-guided fuzzing of the packet decoder; its test is skipped where it cannot install
	$(BIN)/python -m pip install --quiet "atheris>=2.3" || echo "note: atheris not installed; its fuzz test will be skipped"
	touch $(STAMP)

demo: setup
	$(BIN)/mindpulse launch cluster_configs/local_cpu.yaml

# ruff, then the import contracts (pyproject.toml [tool.importlinter])
lint: setup
	$(BIN)/ruff check .
	LINT_IMPORTS=$(CURDIR)/$(BIN)/lint-imports tools/lint_imports.sh

# The tests that start no Ray cluster and no ranks run in parallel processes (one per core,
# at most 4): `make test-quick` the quick ones, `make test` the slow ones among them too
# (graph compiles, long property searches, the browser). Then the `cluster` ones (real clusters,
# ranks and launches), CLUSTER_WORKERS side by side: a launch spends most of its time waiting
# (Ray's start, the ranks' imports, a fault's timeout), so on 2 cores three at once finish in
# about half the time one after another takes; the tests sharing a module fixture stay in one
# worker, the longest start first (tests/suite_schedule.py; `--no-loadscope-reorder` keeps that
# order; refresh the lengths with `--cluster-durations-out tests/cluster_durations.json`).
# Last the `exclusive` ones, alone, one at a time:
# their verdict depends on the wall clock (a slow rank judged against the others, a hang limit).
# The slowest 25 are listed at the end of each part; the budget is 25 minutes here.
PARALLEL        := -n auto --maxprocesses 4
QUICK           := -m "not slow" $(PARALLEL)
CLUSTER_WORKERS ?= 3

test: lint
	$(BIN)/python -m pytest tests -q -m "not cluster" $(PARALLEL) --durations=10
	$(BIN)/python -m pytest tests -q -m "cluster and not exclusive" -n $(CLUSTER_WORKERS) --dist loadgroup \
	  --no-loadscope-reorder --durations=25
	$(BIN)/python -m pytest tests -q -m "cluster and exclusive" --durations=10

test-quick: lint
	$(BIN)/python -m pytest tests -q $(QUICK)

# the performance pieces (under 20 minutes here), then docs/benchmarks.md rewritten; the rules
# campaign (real launches, healthy and with injected faults: about 45 minutes) is its own target
bench: setup
	$(BIN)/python bench/run_all.py

bench-rules: setup
	$(BIN)/python bench/run_all.py --only rules

# every supported MindSpore/MindFormers pair in a cached venv of its own (~/.cache/mindpulse/compat),
# each feature a short real launch; rewrites docs/compat.md (COMPAT_ARGS: e.g. --pairs ms2.10.0)
compat: setup
	$(BIN)/python compat/run_matrix.py $(COMPAT_ARGS)

pretrain: setup
	$(BIN)/mindpulse pretrain --steps 400

clean:
	rm -rf runs .pytest_cache .hypothesis
