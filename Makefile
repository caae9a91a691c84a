# The targets CI calls are the ones a person runs: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# corral alone, without the provider extras: what `make run` and `make shell` need.
RUN_STAMP := $(VENV)/.run-stamp
PYTEST_ARGS ?=

.PHONY: all install run shell test unit lint format typecheck pytest bench bench-smoke sandbox-image up down clean

all: test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The demo runs on the local provider, which needs no SDK: corral and its own dependencies
# (a deployment adds the extras of the providers it names, docs/providers/README.md).
$(RUN_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $(RUN_STAMP)

# Everything the tests need. The provider SDK extras are installed for the tests, which
# prove importing `corral.providers` loads none of them.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev,docker,kubernetes,e2b,vercel,modal,daytona,agentrun,s3]'
	touch $(STAMP) $(RUN_STAMP)

install: $(STAMP)

run: $(RUN_STAMP)
	$(BIN)/corral dev --demo

# A shell with the venv's `corral` on PATH (exit to leave it).
shell: $(RUN_STAMP)
	@echo "corral is on PATH in this shell ($(BIN)); exit to leave it"
	@PATH="$(CURDIR)/$(BIN):$$PATH" VIRTUAL_ENV="$(CURDIR)/$(VENV)" $${SHELL:-/bin/sh}

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

typecheck: $(STAMP)
	$(BIN)/mypy

# pytest runs the tests in PYTEST_WORKERS processes at once (pytest-xdist): most of them wait
# on the processes they start, so more than the 2 cores pay. A test file goes to one worker
# whole (its module-scoped fixtures, an acceptance module's stack, start once), in collection
# order: the acceptance tier first, the unit tests last. PYTEST_WORKERS=0: in this process.
# A test marked `alone` holds a bound in wall-clock time (the README walkthrough's dispatch
# routed within a second of its start), which a machine loaded by the other tests stretches
# past any bound: those run after the rest, by themselves. Either run finding no test is a
# failure (pytest's exit 5), unless PYTEST_ARGS narrowed the run to the other's tests.
PYTEST_WORKERS ?= 3
NARROWED := $(if $(strip $(PYTEST_ARGS)),true,false)
pytest: $(STAMP)
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not alone" \
		$(PYTEST_ARGS) || { status=$$?; [ $$status -eq 5 ] && $(NARROWED) || exit $$status; }
	$(BIN)/pytest -m alone $(PYTEST_ARGS) \
		|| { status=$$?; [ $$status -eq 5 ] && $(NARROWED) || exit $$status; }

test: lint typecheck pytest

# The fast tier alone: no servers, well under a minute.
unit: $(STAMP)
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

# Needs Redis and PostgreSQL on 127.0.0.1, bubblewrap and root for a private dockerd; numbers
# go to docs/benchmarks.md by hand. Each line is one benchmark (or one part of one), the list
# every benchmark must be on: `make test` runs each line in its smoke mode
# (tests/acceptance/test_benchmarks.py; the longest first, a few at a time), and so does
# `make bench-smoke`.
BENCH_ARGS ?=
bench: $(STAMP)
	$(BIN)/python -m bench.dispatch $(BENCH_ARGS)
	$(BIN)/python -m bench.warm $(BENCH_ARGS)
	$(BIN)/python -m bench.fairness $(BENCH_ARGS)
	$(BIN)/python -m bench.latency $(BENCH_ARGS)
	$(BIN)/python -m bench.routing --what anchor $(BENCH_ARGS)
	$(BIN)/python -m bench.routing --what schedulers $(BENCH_ARGS)
	$(BIN)/python -m bench.routing --what events $(BENCH_ARGS)
	$(BIN)/python -m bench.routing --what scale $(BENCH_ARGS)
	$(BIN)/python -m bench.http_intake $(BENCH_ARGS)
	$(BIN)/python -m bench.provisions $(BENCH_ARGS)
	$(BIN)/python -m bench.provisions --celery-only $(BENCH_ARGS)
	$(BIN)/python -m bench.console $(BENCH_ARGS)
	$(BIN)/python -m bench.reaper $(BENCH_ARGS)
	$(BIN)/python -m bench.statements $(BENCH_ARGS)
	$(BIN)/python -m bench.local_start $(BENCH_ARGS)
	$(BIN)/python -m bench.docker_overhead $(BENCH_ARGS)

# Every benchmark once at tiny sizes, one round: that it runs to the end and prints its
# figures (they measure nothing).
bench-smoke: $(STAMP)
	$(MAKE) bench BENCH_ARGS=--smoke

# The Docker sandbox image corral-sandbox:dev, built without a registry (deploy/images/README.md).
# Talks to the engine DOCKER_HOST names; needs root for debootstrap the first time.
sandbox-image:
	deploy/images/sandbox/build.sh

# The whole control plane on this host from docker-compose.yml (deploy/README.md), with
# Compose v2 (`docker compose`) or the standalone docker-compose, whichever is installed.
COMPOSE = $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)

up:
	$(COMPOSE) up --build -d

down:
	$(COMPOSE) down

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
