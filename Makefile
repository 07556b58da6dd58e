# Tandem: two commands on a fresh machine.
#   make serve   - create .venv, install, make the default model if absent, start the
#                  local cluster (Ray: 1 prefill + 1 decode worker, router on :50051/:8000)
#   make test    - create .venv, install, lint, type-check, run the whole test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODEL_DIR ?= models/tandem-small
MODEL_PRESET ?= small
# CPU machines take the local CPU wheel; a CUDA machine takes a CUDA build.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch>=2.4" || echo "torch==2.13.0")
PYTEST_ARGS ?=
# `make test` runs pytest in two processes (pytest-xdist): tests go to whichever is free,
# except that modules killing or signalling a cluster's processes run in one, one at a
# time (tests/helpers/parallel.py). PYTEST_WORKERS=0 runs everything in one process.
PYTEST_WORKERS ?= 2

.PHONY: install serve demo test lint typecheck proto bench-engine bench-experiments clean

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

$(MODEL_DIR)/config.json: | $(VENV)/.installed
	$(VENV)/bin/tandem model make --preset $(MODEL_PRESET) --out $(MODEL_DIR)

SERVE_ARGS ?=

serve: $(VENV)/.installed $(MODEL_DIR)/config.json
	$(VENV)/bin/tandem serve --model $(MODEL_DIR) $(SERVE_ARGS)

demo: $(VENV)/.installed $(MODEL_DIR)/config.json
	$(VENV)/bin/tandem demo --model $(MODEL_DIR)

test: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(MAKE) --no-print-directory typecheck
	$(PY) -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# Regenerate the Python stubs (committed; tests/proto checks they are current).
proto: $(VENV)/.installed
	$(PY) -m tandem.proto.codegen

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy cannot read setuptools' editable finder (folder `engine/` -> `tandem.engine`), so
# each top-level folder is linked as build/typecheck/tandem/<folder>, the path that
# [tool.mypy] in pyproject.toml names; the links are rebuilt on every run. PACKAGES is
# setup.py's TOP_LEVEL.
PACKAGES := engine worker telemetry prefill_worker decode_worker kv_transfer router proto \
	cluster planner bench
TYPECHECK_ROOT := build/typecheck
typecheck: $(VENV)/.installed
	rm -rf $(TYPECHECK_ROOT)
	mkdir -p $(TYPECHECK_ROOT)/tandem
	for name in $(PACKAGES); do ln -s ../../../$$name $(TYPECHECK_ROOT)/tandem/$$name; done
	$(VENV)/bin/mypy $(addprefix -p tandem.,$(PACKAGES))

bench-engine: $(VENV)/.installed
	$(VENV)/bin/tandem-bench engine --out docs/benchmarks.md

# The published experiments (head-of-line, frontier, goodput; peer: transformers serve,
# which needs the [bench] extra). About 50 minutes on 2 cores; run on a quiet machine.
EXPERIMENT ?= all
bench-experiments: $(VENV)/.installed $(MODEL_DIR)/config.json
	$(PY) -m pip install --quiet -e ".[dev,bench]"
	$(VENV)/bin/tandem-bench experiment $(EXPERIMENT) --model $(MODEL_DIR)

clean:
	rm -rf $(VENV) build *.egg-info
