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
# The torch build installed (e.g. 2.13.0+cpu): pinned again wherever pip resolves, so that it
# never backtracks into another torch build.
TORCH_VERSION = $(PY) -c 'import torch; print(torch.__version__)'

.PHONY: setup demo test lint proto bench clean

$(STAMP): pyproject.toml setup.py flashckpt/_verified_copy.c flashckpt/_crc32c.h
	$(PYTHON) -m venv $(VENV)
	# The pinned CPU build first: a bare torch requirement would pull the CUDA build. numpy and
	# the build tools come with it: DeepSpeed's build below imports them while the rest installs.
	$(PIP) torch==2.13.0 numpy setuptools wheel $(TORCH_PIP_ARGS)
	# DeepSpeed ships as source: built against this torch, as a wheel, while the rest installs.
	# Its CPU shared-memory op is compiled into that wheel. Left to be built on first use, it
	# is built under a lock file, and a process killed while holding that lock leaves every
	# later DeepSpeed process on the machine waiting for it forever. CXXFLAGS: the flags DeepSpeed
	# itself builds it with on first use (Python's own add -g, a quarter of the compile time).
	rm -rf build/wheels; mkdir -p build/wheels
	CXXFLAGS=-g0 DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 $(VENV)/bin/pip wheel -q --no-deps --no-cache-dir \
		--no-build-isolation -w build/wheels deepspeed==0.19.8 >build/deepspeed-wheel.log 2>&1 & \
	deepspeed=$$!; \
	$(PIP) -e '.[dev]' "torch==$$($(TORCH_VERSION))"; rest=$$?; \
	if ! wait $$deepspeed; then tail -n 30 build/deepspeed-wheel.log; exit 1; fi; \
	exit $$rest
	$(PIP) build/wheels/deepspeed-*.whl "torch==$$($(TORCH_VERSION))"
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
