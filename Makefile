# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.forebay-installed
DEMO   ?= .demo

.PHONY: demo test lint venv bench clean

venv: $(STAMP)

# torch: the CPU build on a machine without a GPU (scripts/torch_index.py says where
# from; FOREBAY_TORCH_INDEX=URL or =none overrides). -qq: errors only (a machine's pip
# configuration can print dozens of warnings about its own index locations)
$(STAMP): pyproject.toml requirements-dev.txt setup.py src/forebay/_native.c src/forebay/_jpeg.c \
          scripts/torch_index.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq --disable-pip-version-check \
	    $$($(PY) scripts/torch_index.py) -r requirements-dev.txt
	@$(PY) scripts/torch_index.py --check
	@touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/mypy

# the test files spread over the cores (up to 4), each file in one process: the
# emulated cluster of tests/test_cluster.py is built once, in the process that runs it
test: lint
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile

demo: $(STAMP)
	@PATH="$(abspath $(VENV))/bin:$$PATH" bash scripts/demo.sh $(DEMO)

bench: $(STAMP)
	$(PY) benchmarks/format/format_bench.py --out $(DEMO)/bench

clean:
	rm -rf $(DEMO) build src/*.egg-info .pytest_cache
