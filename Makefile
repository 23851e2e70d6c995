# Two commands a newcomer needs: `make demo` (the main job end to end on the tiny default) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true
export HF_HUB_OFFLINE := 1

include infra/terraform/tools.mk

.PHONY: venv demo test bench models clean

# torch is installed first, pinned, so pip takes the CPU wheel and never resolves a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

models: venv
	@test -f .rlhf/models/tiny/tiny.json || $(VENV)/bin/rlhf models tiny --out .rlhf/models/tiny

demo: venv models
	$(VENV)/bin/rlhf demo

# Test files run in parallel, one pytest worker per core (pytest-xdist); a file's tests stay on one worker, in order,
# because modules share expensive fixtures (a whole local stack, a critic server).
test: venv tools
	$(PY) -m pytest -q -n auto --dist loadfile

bench: venv models
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) -m benchmarks.run_all

clean:
	rm -rf .rlhf
