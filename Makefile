# Two commands do all set-up on a fresh machine:
#   make serve   builds the venv if needed, then serves the built-in demo model
#   make test    builds the venv if needed, then runs the test suite
#   make bench   adds the benchmark extras, then compares Conveyor's scheduling modes and transformers serve
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: serve test venv clean proto bench

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned to the local CPU wheel, so that nothing pulls CUDA packages.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	# Hugging Face's text-generation client, for compatibility tests; it pins huggingface_hub<1, which
	# transformers 5 cannot use, and needs nothing from it that the installed one lacks.
	$(BIN)/pip install --quiet --no-deps text-generation==0.7.0
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/conveyor-launcher --model-id demo $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

# Conveyor's scheduling modes vs `transformers serve` vs the bare forward (benchmarks/compare.py, ~15-20 min on CPU).
bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python -m conveyor.benchmarks.compare $(ARGS)

proto: $(STAMP)
	$(BIN)/python -m conveyor.v1.codegen

clean:
	rm -rf $(VENV) .cache
