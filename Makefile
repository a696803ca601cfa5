# Two commands set up and run everything on a fresh CPU machine:
#   make gate   -- install into .venv, then run the correctness gate on CPU (`mla-verify gate`)
#   make test   -- install into .venv, then run the test suite
# TORCH picks the torch build: torch==2.13.0 is the CPU build these machines keep on local disk.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: gate test install clean

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
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) runs .hypothesis .pytest_cache
