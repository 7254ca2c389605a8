# The two commands: `make demo` and `make test`. Both create (or reuse) the virtual environment
# .venv and install the package (editable, in "compat" mode so that Spark's automatic discovery
# of pyspark_* modules, which uses pkgutil.iter_modules, finds it) with what the tests need.
PYTHON ?= python3
VENV := .venv
BIN := $(abspath $(VENV)/bin)
STAMP := $(VENV)/.installed
export PYSPARK_PYTHON := $(BIN)/python
export PYSPARK_DRIVER_PYTHON := $(BIN)/python

.PHONY: demo test test-fast test-all test-cluster lint bench bench-full soak crash-matrix clean venv

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,dev,bench]" --config-settings editable_mode=compat
	touch $(STAMP)

# Test-only: Azurite, Microsoft's Azure Storage emulator (npm), for the abfs:// cases of the
# store's tests; without npm those cases are skipped and say so, or fail when
# DQ_REQUIRE_BACKENDS=1 (as .ci/run sets it).
AZURITE_DIR := $(VENV)/azurite
AZURITE_STAMP := $(AZURITE_DIR)/.installed
NO_AZURITE := the abfs:// tests will be skipped (they fail with DQ_REQUIRE_BACKENDS=1)

$(AZURITE_STAMP): | $(STAMP)
	@if command -v npm >/dev/null 2>&1; then \
	  npm install --silent --no-audit --no-fund --prefix $(AZURITE_DIR) azurite@3.37.0 \
	    && touch $@ || echo "could not install Azurite: $(NO_AZURITE)"; \
	else echo "npm (Node.js) not found: $(NO_AZURITE)"; fi

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# The suite runs in TEST_WORKERS pytest-xdist worker processes (TEST_WORKERS=0: in this one).
# Much of its time is spent waiting (JVM starts, streaming triggers, children to kill, the S3
# and Azure test servers), so on CI's 2 cores 3 workers finish it sooner than 1.
# --dist loadfile: a test file's tests run on one worker, one after another (its module
# fixtures are made once; a worker starts its own SparkSession for the first Spark test it
# gets, at most one per worker). Not loadgroup: pytest-xdist 3.8.0's loadgroup silently
# stops grouping on pytest 9.2 (pytest-xdist issue 1386). --no-loadscope-reorder: the files
# go out in the order tests/conftest.py gives them, those with the longest tests first.
TEST_WORKERS ?= 3
PYTEST := $(BIN)/python -m pytest -q --durations=15 $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: $(STAMP) $(AZURITE_STAMP)
	$(PYTEST)

test-fast: $(STAMP) $(AZURITE_STAMP)
	$(PYTEST) -m "not spark and not crash and not slow"

# The whole suite at full size: the crash tests' longer runs (each test names what its
# variable sizes and the size `make test` uses).
FULL_SIZE := DQ_CRASH_CYCLES=30 DQ_SPARK_CRASH_KILLS=8 DQ_CRASH_MESSAGES=100000

test-all: $(STAMP) $(AZURITE_STAMP)
	$(FULL_SIZE) $(PYTEST)

# Opt-in, not part of `make test`: the sink's and source's end-to-end tests on a Spark standalone
# cluster (a master and two workers of 1 core / 1 GiB from the pyspark package, on 127.0.0.1,
# started and stopped by the tests' `spark` fixture: tests/spark_cluster.py), so that tasks run
# in executor JVMs and Python workers of their own. One session, one cluster: no -n.
CLUSTER_TESTS ?= tests/test_spark_cluster.py tests/test_spark_sink.py tests/test_spark_source.py \
	tests/test_spark_multi.py tests/test_spark_journal.py tests/test_spark_s3.py

test-cluster: $(STAMP)
	DQ_SPARK_CLUSTER=1 $(BIN)/python -m pytest -q --durations=15 -m spark $(CLUSTER_TESTS)

lint: $(STAMP)
	$(BIN)/ruff check pyspark_durable_queue tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache --no-logo

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

bench-full: $(STAMP)
	$(BIN)/python benchmarks/run_all.py --full

# The soak (benchmarks/soak.py): producers, single senders, an exclusive consumer, a shared
# consumer's pool, cleanup and compaction and a Spark streaming query on one store for
# SOAK_SECONDS (default 30 minutes), sampling RSS, descriptors, threads, files and log entries;
# fails on a trend after the warm-up. Results (PNG, CSV, summary) in soak-results/ (gitignored).
SOAK_SECONDS ?= 1800

soak: $(STAMP)
	nice $(BIN)/python benchmarks/soak.py --seconds $(SOAK_SECONDS)

# The kill matrix (tests/kill_matrix.py): every role (batch, single, scheduled and TTL senders,
# an exclusive consumer, a shared consumer's pool, cleanup, compaction) forked from one warm
# parent and SIGKILLed at random moments, KILLS times (each kill proven), the whole history
# audited every KILL_CHECK kills and at the end; prints the kills, rounds, audits, time and the
# seed (DQ_CRASH_SEED=... repeats a run). The suite runs 100 (tests/test_kill_matrix.py).
KILLS ?= 10000
KILL_CHECK ?= 500

crash-matrix: $(STAMP)
	nice -n 10 $(BIN)/python tests/kill_matrix.py --kills $(KILLS) --check-every $(KILL_CHECK)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
