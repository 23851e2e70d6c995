# syntax=docker/dockerfile:1
# The actor image ($RLHF_IMAGE in prefect.yaml): rlhf-flows with CUDA torch, for every pod of the actor-gpu and
# critic-gpu work pools (training flows and their actor ranks, critic and reward servers, compare, sweep).
#
#   make image                                  # builds this and docker/vllm.Dockerfile with the project's pins
#
# The pins are the project's own: torch from TORCH_VERSION (make passes pyproject.toml's pin; the default here is the
# same, tests/infra/test_images.py checks), every other dependency read from pyproject.toml at build time. PyPI's
# Linux wheel of torch is the CUDA build (its CUDA libraries come as nvidia-* wheels); the driver comes from the
# node (the AL2023 NVIDIA AMI of the GPU pools). Python 3.11 as in CI; glibc 2.36 (PyTriton's Triton needs >= 2.35)
# and a shared libpython (Triton's python backend links it) come with the official image.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm

ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    DO_NOT_TRACK=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    MLFLOW_DISABLE_TELEMETRY=true

# Prefect's pull step runs every flow from here (prefect.yaml: set_working_directory /opt/rlhf-flows); the package is
# installed editable from it, so the project root the servers' children import from is this directory.
WORKDIR /opt/rlhf-flows

# torch first and alone, pinned: nothing later may resolve another build of it
RUN pip install "torch==${TORCH_VERSION}"

# the dependencies exactly as pyproject.toml lists them (a layer of their own: code changes do not reinstall them)
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# verifiers' own environment (environment.verifiers runs its environments there: components/verifiers/, its worker
# started as .venv-verifiers/bin/python under the project root), with the pins of the Makefile's verifiers-venv target
# (VERIFIERS_PINS: make passes them, the default here is the same, tests/infra/test_images.py checks); no torch in it
ARG VERIFIERS_PINS="verifiers==0.2.1 openai==3.57.0 httpx==0.28.1 pydantic==2.14.4 datasets==5.2.0"
RUN python -m venv .venv-verifiers \
    && .venv-verifiers/bin/pip install ${VERIFIERS_PINS} \
    && .venv-verifiers/bin/python -c "import verifiers"

COPY models/ models/
COPY components/ components/
COPY flows/ flows/
# the shipped configs and reward files (examples/README.md): `reward.function: examples/rewards/gsm8k.py:...` resolves
# against this working directory in every pod (a run also stores its reward files in its store: models/reward.py)
COPY examples/ examples/
COPY prefect.yaml ./
RUN pip install --no-deps -e . && python -c "import components, flows, models"

# not root: the pod needs no privilege (S3 comes from the service account's IRSA role, state under RLHF_STATE_DIR)
RUN useradd --create-home --uid 1000 rlhf
USER 1000
