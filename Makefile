# Two commands do all the set-up on a fresh machine:
#   make demo   # fault-tolerant training demo (CPU, local directory tier, agent auto-started)
#   make test   # the whole test suite (what .ci/run runs)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.flashckpt-installed
# No byte-compiling at install: of the ~16,000 modules installed, a process compiles the few it
# imports, once, on first use (compiling all of them took a minute of CPU).
PIP := $(VENV)/bin/pip install -q --no-compile
# Extra pip arguments for torch, e.g. --index-url https://download.pytorch.org/whl/cpu
TORCH_PIP_ARGS ?=

.PHONY: setup demo test lint proto bench clean

$(STAMP): pyproject.toml setup.py flashckpt/_verified_copy.c flashckpt/_crc32c.h
	$(PYTHON) -m venv $(VENV)
	# The pinned CPU build first: a bare torch requirement would pull the CUDA build.
	$(PIP) torch==2.13.0 $(TORCH_PIP_ARGS)
	# Pin exactly the build just installed (e.g. 2.13.0+cpu), so resolving the rest never
	# backtracks into another torch build.
	$(PIP) -e '.[dev]' "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	# DeepSpeed ships as source: built against this torch, with no ops compiled (CPU runs).
	$(PIP) setuptools wheel
	DS_BUILD_OPS=0 $(PIP) --no-build-isolation deepspeed==0.19.8 \
		"torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# Two processes share the machine's cores; the tests that judge by the clock then run alone.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal -m "not serial" --durations=25
	$(PY) -m pytest -q -m serial --durations=10

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

proto: $(STAMP)
	$(PY) proto/generate.py

bench: $(STAMP)
	$(PY) benchmarks/snapshot.py

clean:
	rm -rf $(VENV) build *.egg-info
