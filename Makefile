# agentruns: `make demo` and `make test` set everything up themselves on a fresh machine
# (Python 3.11+, Java 17+, Maven; root for apt-get when Postgres, Chromium or promtool is missing).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: help setup venv broker-jars postgres chromium prometheus phoenix demo test check unit integration lint typecheck docs fmt bench clean

help:
	@echo "make demo   - set up, start Kafka + Postgres locally, run the demo scenarios"
	@echo "make test   - set up, then ruff, mypy, the import contracts, the docs build and the whole pytest suite (real broker + db; promtool on the Prometheus rules)"
	@echo "make check  - the same without the docs and the tests marked slow (chaos, clusters, kills): a few minutes"
	@echo "make lint | typecheck | docs | unit | integration | bench | fmt | clean"

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "agentruns needs Python 3.11+ (found " + sys.version.split()[0] + ")")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The tests run the Faust extra against the broker; the docker extra is what the stack uses
	# when a Docker engine answers (the suite's broker then comes from a container).
	$(PY) -m pip install -q -e '.[dev,faust,docker]'
	@touch $(STAMP)

venv: $(STAMP)

# The broker jars come from Maven Central through connectors/dev/stack/kafka/pom.xml, cached outside the
# repo (~/.cache/agentruns/kafka-<version>, or $$AGENTRUNS_KAFKA_HOME).
broker-jars: $(STAMP)
	@command -v java >/dev/null || { echo "java is missing: install a JDK 17+ (apt-get install -y openjdk-17-jre-headless)"; exit 2; }
	@$(PY) -c 'from agentruns.connectors.dev.stack.local_kafka import ensure_jars; print("kafka jars:", ensure_jars())' \
	  || { echo "could not fetch the Kafka jars (is mvn installed? apt-get install -y maven)"; exit 2; }

# Postgres server binaries: Debian's package when missing and we are root.
postgres: $(STAMP)
	@if $(PY) -c 'from agentruns.connectors.dev.stack.local_postgres import find_bindir; find_bindir()' 2>/dev/null; then \
	  echo "postgres: $$($(PY) -c 'from agentruns.connectors.dev.stack.local_postgres import find_bindir; print(find_bindir())')"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing PostgreSQL with apt-get"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; \
	else \
	  echo "PostgreSQL server binaries are missing: install them (e.g. sudo apt-get install -y postgresql)"; exit 2; \
	fi

# Chromium and its WebDriver for the console's browser test: Debian's packages when missing and
# we are root, the same way as Postgres.
chromium:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then \
	  echo "chromium: $$(command -v chromium), chromedriver: $$(command -v chromedriver)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing chromium and chromium-driver with apt-get"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else \
	  echo "Chromium is missing: install it (e.g. sudo apt-get install -y chromium chromium-driver)"; exit 2; \
	fi

# promtool, which checks and unit-tests the Prometheus rules (deploy/prometheus, in
# tests/unit/test_prometheus_rules.py): Debian's prometheus package when missing and we are
# root, the same way as Postgres.
prometheus:
	@if command -v promtool >/dev/null; then \
	  echo "promtool: $$(command -v promtool)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing prometheus (promtool) with apt-get"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; \
	else \
	  echo "promtool is missing: install it (e.g. sudo apt-get install -y prometheus)"; exit 2; \
	fi

# Arize Phoenix for the tracing test (tests/e2e/test_phoenix_traces.py), in a virtual
# environment of its own: its pins conflict with the project's test dependencies
# (deploy/phoenix/requirements.txt).
PHOENIX_VENV := .venv-phoenix
$(PHOENIX_VENV)/.installed: deploy/phoenix/requirements.txt
	$(PYTHON) -m venv $(PHOENIX_VENV)
	$(PHOENIX_VENV)/bin/python -m pip install -q --upgrade pip
	$(PHOENIX_VENV)/bin/python -m pip install -q -r deploy/phoenix/requirements.txt
	@touch $@

phoenix: $(PHOENIX_VENV)/.installed

setup: venv broker-jars postgres prometheus

demo: setup
	$(VENV)/bin/agentruns demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy reads the source folders through a tree of links laid out as the installed namespace
# (agentruns.processors -> processors/, ...): it cannot follow an editable install's import hook.
# lint-imports (the contracts in pyproject.toml) reads the same tree: it puts its working
# directory first on the path, hence the cd (from the root it would find ./agentruns alone).
typecheck: $(STAMP)
	@mkdir -p build/typecheck/agentruns
	@for d in processors streams schemas connectors bench; do ln -sfn ../../../$$d build/typecheck/agentruns/$$d; done
	@ln -sf ../../../agentruns/__init__.py ../../../agentruns/py.typed build/typecheck/agentruns/
	$(VENV)/bin/mypy
	cd build/typecheck && ../../$(VENV)/bin/lint-imports --no-cache --config ../../pyproject.toml

# The documentation site (mkdocs.yml over docs/, the client API rendered from its docstrings)
# into build/site; warnings fail it. mkdocstrings reads the package through build/typecheck.
docs: typecheck
	$(VENV)/bin/mkdocs build --strict -d build/site

unit: $(STAMP) prometheus
	$(VENV)/bin/pytest tests/unit -q $(PYTEST_ARGS)

integration: setup phoenix
	$(VENV)/bin/pytest tests/integration tests/e2e -q $(PYTEST_ARGS)

# Two workers: most tests wait on the broker, so two run side by side in about the time of one;
# the heavy ones (tests/conftest.py, HEAVY) one after another on one worker.
test: setup chromium phoenix lint typecheck docs
	$(VENV)/bin/pytest -q -rs --durations=15 -n 2 --dist loadgroup $(PYTEST_ARGS)

# The edit-test loop: the same checks and every test not marked slow (tests/conftest.py, SLOW;
# the browser test is one of them, hence no chromium).
check: setup lint typecheck
	$(VENV)/bin/pytest -q -rs --durations=15 -n 2 --dist loadgroup -m "not slow" $(PYTEST_ARGS)

fmt: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: setup
	$(VENV)/bin/agentruns bench core

clean:
	rm -rf $(VENV) $(PHOENIX_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
