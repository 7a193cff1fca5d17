# Set-up and checks. `make test` and `make bench-io` create the venv on first use.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# DeepSpeed chooses its accelerator at import. lohan uses only its async_io op, which moves host memory:
# it is built for the CPU accelerator everywhere, a GPU box included (the same op the tests use).
export DS_ACCELERATOR ?= cpu

.PHONY: help install sysdeps aio-op kernels run test test-all lint bench-io bench-ago clean

help:
	@echo "make run       create .venv, install the packages, run the default fine-tune (configs/tiny.yaml)"
	@echo "make test      create .venv, install everything, run the test suite (fast set)"
	@echo "make test-all  the full suite, slow end-to-end tests included"
	@echo "make kernels   build the compiled update of the compressed state formats (run and test do it)"
	@echo "make bench-io  NVMe I/O benchmark (io_engine vs fio, SSD scaling); writes benchmarks/results/"
	@echo "make lint      ruff"

# torch is installed first and pinned: an unpinned torch (or a package that pulls it in) would
# fetch the multi-GB CUDA build. DeepSpeed is built without isolation so its build sees this torch.
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-build-isolation -e ".[dev,bench,track]"
	@touch $@

install: sysdeps $(VENV)/.installed

# libaio-dev lets DeepSpeed build its async_io op (the `aio` backend). Without it everything
# still works on the portable `threads` backend.
sysdeps:
	@if ! dpkg -s libaio-dev >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing libaio-dev (for the aio backend)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev >/dev/null; \
	  else \
	    echo "NOTE: libaio-dev is missing and this user cannot install it; the aio backend will be"; \
	    echo "      unavailable (tests skip it). To enable it: sudo apt-get install libaio-dev"; \
	  fi; \
	fi

# Build DeepSpeed's async_io op once (first time: minutes; cached in .venv/torch_extensions).
aio-op: install
	@echo "preparing DeepSpeed async_io op (first build takes several minutes on 2 cores)..."
	@timeout 1800 $(PY) -m io_engine info || { echo "io_engine info failed or took over 30 min (exit $$?);" \
	  "see the messages above. The threads backend does not need this op."; exit 1; }

# The compiled update of the compressed state formats (--state-format; about a minute once). Without a compiler
# those formats run on torch ops instead, slower, and the default format does not need it.
kernels: install
	@$(PY) -m lohan.runtime.format_kernel || echo "NOTE: the format kernel did not build; compressed state formats use torch ops"

# The default run needs neither the aio op (backend auto takes the portable threads backend until `make aio-op` or
# `make test` has built it, and never compiles in a run) nor the format kernel (its state format is exact): waiting
# ~8 minutes for their first build on 2 cores would make the first run take four times as long as the run itself.
run: $(VENV)/.installed
	$(PY) finetune.py --overwrite

test: aio-op kernels
	$(PY) -m pytest -q

test-all: aio-op kernels
	$(PY) -m pytest -q -m ""

lint: install
	$(VENV)/bin/ruff check io_engine lohan tests benchmarks finetune.py

bench-io: aio-op
	@command -v fio >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get install -y -qq fio >/dev/null; } || \
	  echo "fio unavailable: io_bench falls back to dd"
	$(PY) benchmarks/io_bench.py

bench-ago: aio-op
	$(PY) benchmarks/ago_bench.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache runs benchmarks/scratch
