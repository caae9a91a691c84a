# The targets CI calls are the ones a person runs: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: all install run shell test unit lint format typecheck pytest bench sandbox-image up down clean

all: test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The provider SDK extras are installed for the tests, which prove importing
	# `corral.providers` loads none of them.
	$(BIN)/python -m pip install --quiet -e '.[dev,docker,kubernetes,e2b,vercel,modal,daytona,agentrun,s3]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/corral dev --demo

# A shell with the venv's `corral` on PATH (exit to leave it).
shell: $(STAMP)
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

pytest: $(STAMP)
	$(BIN)/pytest $(PYTEST_ARGS)

test: lint typecheck pytest

# The fast tier alone: no servers, well under a minute.
unit: $(STAMP)
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

# Needs Redis and PostgreSQL on 127.0.0.1 and bubblewrap; numbers go to docs/benchmarks.md
# by hand.
bench: $(STAMP)
	$(BIN)/python -m bench.routing
	$(BIN)/python -m bench.dispatch
	$(BIN)/python -m bench.docker_overhead
	$(BIN)/python -m bench.reaper
	$(BIN)/python -m bench.provisions
	$(BIN)/python -m bench.local_start
	$(BIN)/python -m bench.latency
	$(BIN)/python -m bench.statements
	$(BIN)/python -m bench.console

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
