# The two commands of the README:
#   make run   install what is missing, then serve the embedded default (tiny checkpoint) and print the demo URL
#   make test  install what is missing, then run the tests
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
TESTS ?= tests

.PHONY: install run test test-e2e lint

install:
	@bash scripts/install.sh $(VENV)

run: install
	$(VENV)/bin/duplex serve $(ARGS)

test: install
	$(PY) -m pytest $(TESTS) -q $(PYTEST_ARGS)

test-e2e: install
	$(PY) -m pytest $(TESTS) -q -m e2e $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
