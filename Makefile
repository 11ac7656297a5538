PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# pytest-xdist workers; each test module compiles its own tiny models.
WORKERS ?= 2

.PHONY: demo test install install-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(VENV)/.installed $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed
	$(BIN)/sdcstudy demo

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n $(WORKERS) --dist loadscope --durations=15 tests

clean:
	rm -rf $(VENV) build *.egg-info
