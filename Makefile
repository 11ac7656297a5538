PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# pytest-xdist workers; they and the subprocesses they start share the session's compilation
# cache (tests/conftest.py).
WORKERS ?= 2

.PHONY: demo tour test test-fast install install-test clean

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

# README's tour: run the demo once and rewrite its output block (docs/developing.md).
tour: $(VENV)/.installed
	$(BIN)/python -m sdcstudy.dev.tour

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n $(WORKERS) --dist loadscope --no-loadscope-reorder --durations=15 tests

# The quick tier for the inner loop (docs/developing.md, "Tests: two tiers"): the unit-level
# modules, less their end-to-end runs marked slow. `make test` runs these too, slow ones included.
FAST_TESTS := $(addprefix tests/test_,$(addsuffix .py,config architecture fault_model tables \
	runlock report report_bits_abft fleet deploy gpu_acceptance gpu_free_step embedding paft_checks \
	hostmem reproduce mode_bits ticker paired_summary profile_mistakes profile_descriptions \
	pairing_checks resume_refusals reproduce_command doc_commands card_figures bitwise \
	metrics_promises golden_promises reproduce_promises deploy_promises guide2_promises \
	config_keys command_interrupts))

test-fast: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n $(WORKERS) --dist loadscope --no-loadscope-reorder --durations=10 -m "not slow" $(FAST_TESTS)

clean:
	rm -rf $(VENV) build *.egg-info
