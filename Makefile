# Crowdtrain: `make run` sets everything up and runs the platform; `make test` runs the whole test suite.
#
# Overrides (environment or `make VAR=value`):
#   PYTHON=python3.11        interpreter used to create .venv
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
#                            extra pip index for the CPU build of torch, on machines whose pip
#                            configuration does not already provide it
#   PYTEST_ARGS="-m 'not browser'"   extra arguments for pytest
#   PYTEST_WORKERS=3         pytest-xdist worker processes for `make test` (0: one process)

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_INDEX_URL ?=
PIP_INSTALL := $(PY) -m pip install --disable-pip-version-check $(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL))
PYTEST_ARGS ?=

# Stamp files named after the hash of what they were built from: a changed file means a new stamp.
hash = $(shell cat $(1) | sha256sum | cut -c1-16)
RUN_STAMP := $(VENV)/.installed-$(call hash,requirements.txt)
DEV_STAMP := $(VENV)/.installed-dev-$(call hash,requirements.txt requirements-dev.txt)
NODE_STAMP := node_modules/.installed-$(call hash,package-lock.json)

define forget-old-stamps
find $(VENV) -maxdepth 1 -name '.installed-*' ! -name '$(notdir $(RUN_STAMP))' ! -name '$(notdir $(DEV_STAMP))' -delete
endef

.PHONY: help run test test-js lint docker setup setup-dev vendor fuzz messages bench-server bench-sockets bench-pipeline

help:
	@echo "make run     set up (.venv, npm, database, admin, demo data) and run the platform on http://127.0.0.1:8000"
	@echo "make test    set up the dev tools and run the whole test suite"
	@echo "make test-js the browser engine's shared facts (engine/spec.json) in Node, no browser"
	@echo "make lint    ruff (lint and format), mypy (tests and benchmarks too) and eslint; part of make test"
	@echo "make messages  update locale/*/django.po from the templates and code, and compile them (needs GNU gettext)"
	@echo "make fuzz    the long protocol fuzz against the real stack (FUZZ_ARGS=\"--frames 100000 --minutes 30\")"
	@echo "make bench-server  the server's costs (aggregation, work-unit throughput curve, two projects on one fleet; before/after, ~26 min); results/server-*"
	@echo "make bench-sockets  one daphne: idle volunteers, a reconnect storm, mass close (~4 min); server-sockets.json"
	@echo "make bench-pipeline  pipeline vs data parallel, emulated time (~2 min); benchmarks/results/pipeline.*"
	@echo "make docker  docker compose up --build (production shape; needs .env, see platform/env.example)"

$(PY):
	$(PYTHON) -m venv $(VENV)

# Each install is tried twice: a registry that answers one request badly (pip's resolver then crashed with
# "expected string or bytes-like object, got 'NoneType'" on a fresh clone) must not fail a whole CI run.
$(RUN_STAMP): | $(PY)
	$(PIP_INSTALL) -r requirements.txt || $(PIP_INSTALL) -r requirements.txt
	$(forget-old-stamps)
	touch $@

$(DEV_STAMP): | $(PY)
	$(PIP_INSTALL) -r requirements-dev.txt || $(PIP_INSTALL) -r requirements-dev.txt
	$(forget-old-stamps)
	touch $@ $(RUN_STAMP)

# Only when missing: the lockfile is committed, and `npm ci` installs exactly what it says.
package-lock.json:
	npm install --package-lock-only --no-audit --no-fund

$(NODE_STAMP): package-lock.json
	npm ci --no-audit --no-fund
	touch $@

vendor: $(NODE_STAMP) | $(PY)
	$(PY) scripts/vendor_static.py

setup: $(RUN_STAMP) vendor
	$(PY) manage.py migrate --noinput
	$(PY) manage.py ensure_admin
	$(PY) manage.py seed_demo

setup-dev: $(DEV_STAMP) vendor

run: setup
	exec $(PY) manage.py runplatform

# Lint first: a tree that does not pass it is not tested (CI runs exactly this target). Three pytest-xdist
# workers, a test file at a time each (a module's stack starts once); tests/environment.py gives each worker
# its own databases and Redis. PYTEST_WORKERS=0 runs the suite in one process.
PYTEST_WORKERS ?= 3
test: setup-dev lint test-js
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Node only (node:test, no npm packages, no browser): a few hundred milliseconds.
test-js:
	node --test tests/js/*.test.mjs

# benchmarks/security/fuzz.py: 100,000 hostile frames (or 30 minutes) while honest volunteers train; a table
# and benchmarks/results/security_fuzz.json. Fails on any crash, stall, traceback, 500 or broken invariant.
FUZZ_ARGS ?=
fuzz: setup-dev
	$(PY) -m benchmarks.security.fuzz $(FUZZ_ARGS)

# benchmarks/server: the server's costs on this machine (aggregation: an int8 ResNet-18 update folded into its
# round and a version published, before and after issue 15); a table and benchmarks/results/server-*.json.
# Uses a scratch PostgreSQL database (BENCH_SERVER_ARGS="--database NAME", dropped and created anew).
# Then the work-unit throughput curve on the real stack, main ("before", a temporary git worktree) and this
# checkout side by side (~15 min; shorter: BENCH_THROUGHPUT_ARGS="--volunteers 8,64 --seconds 20 --no-before"):
# benchmarks/results/server-throughput.json and .png. Last, two crowd averaging projects sharing one fleet of
# simulated volunteers, their rounds' length against target_seconds (~6 min, before and after likewise;
# BENCH_SHARED_FLEET_ARGS="--before-rev REV"): benchmarks/results/server-shared-fleet.json.
BENCH_SERVER_ARGS ?=
BENCH_THROUGHPUT_ARGS ?=
BENCH_SHARED_FLEET_ARGS ?=
bench-server: setup-dev
	$(PY) -m benchmarks.server.run $(BENCH_SERVER_ARGS)
	$(PY) -m benchmarks.server.throughput $(BENCH_THROUGHPUT_ARGS)
	$(PY) -m benchmarks.server.shared_fleet $(BENCH_SHARED_FLEET_ARGS)

# benchmarks/server/sockets.py: one daphne on the real stack, N idle volunteers, K simultaneous reconnects, all
# closing at once (a few minutes; its own target so bench-server stays quick). Drops and creates its database.
# At the issue's scale, as root (it raises its own RLIMIT_NOFILE; otherwise `ulimit -Hn 131072` first):
# BENCH_SOCKETS_ARGS="--volunteers 50000 --storm 10000 --heartbeat 10"; results in server-sockets.json.
BENCH_SOCKETS_ARGS ?=
bench-sockets: setup-dev
	$(PY) -m benchmarks.server.sockets $(BENCH_SOCKETS_ARGS)

# benchmarks/pipeline: pipeline mode (GPT at six widths, ResNet-18; 2, 4, 8 stages x 1-4 volunteers) against
# data-parallel sync and averaging, as an emulation of time over real graphs, partitions and GPipe timetables;
# a table, benchmarks/results/pipeline.json and pipeline.png. No database.
bench-pipeline: setup-dev
	$(PY) -m benchmarks.pipeline

# The compiled .mo files are committed, so running the platform needs no gettext; translators run this.
MESSAGE_DIRS := --ignore=.venv --ignore=node_modules --ignore=var --ignore=tests --ignore=benchmarks --ignore=client --ignore=frontend/vendor
messages: $(RUN_STAMP)
	$(PY) manage.py makemessages --locale fr --no-obsolete --no-location $(MESSAGE_DIRS)
	$(PY) manage.py compilemessages --locale fr $(MESSAGE_DIRS)

lint: $(DEV_STAMP) $(NODE_STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	npx --no-install eslint .

docker:
	docker compose up --build
