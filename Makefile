# Two commands set up and run everything on a fresh CPU machine:
#   make gate   -- install into .venv, then run the correctness gate on CPU (`mla-verify gate`)
#   make test   -- install into .venv, then run the test suite
# `make docs` builds the documentation site (docs/, mkdocs.yml) into site/, warnings as errors.
# TORCH picks the torch build: torch==2.13.0 is the CPU build these machines keep on local disk.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: gate test docs install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

gate: $(STAMP)
	$(BIN)/mla-verify gate --device cpu

test: $(STAMP)
	# one test process a core, up to 4 (the tests start workers of their own); the slowest listed:
	# CI's time is a budget (15 min on 2 cores)
	$(BIN)/python -m pytest -n auto --maxprocesses 4 --durations=15

# The site's CLI and API pages are generated from the code as it builds (scripts/docs_reference.py).
docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

$(VENV)/.docs-installed: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[docs]'
	touch $@

clean:
	rm -rf $(VENV) runs site .hypothesis .pytest_cache .mla-verify
