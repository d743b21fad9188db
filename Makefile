# The two commands of the README:
#   make run   install what is missing, then serve the embedded default (tiny checkpoint) and print the demo URL
#   make test  install what is missing, then run the tests
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
TESTS ?= tests
# Two pytest-xdist workers, a test file each at a time (its module fixtures, e.g. an e2e stack, stay in one worker):
# on a 2-core machine the suite took 1230 s in one process, 834 s so. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile

.PHONY: install run test test-e2e lint

install:
	@bash scripts/install.sh $(VENV)

run: install
	$(VENV)/bin/duplex serve $(ARGS)

test: install
	$(PY) -m pytest $(TESTS) -q $(XDIST) $(PYTEST_ARGS)

test-e2e: install
	$(PY) -m pytest $(TESTS) -q -m e2e $(XDIST) $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
