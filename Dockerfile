# Images for compose.yaml, one per engine (`docker build --target cpu .` or `--target gpu`):
#   cpu (the default): the CPU engine on PyTorch's CPU build, the API, the operator commands
#       and make-tiny-model: README.md's install, '.[cpu]' (its `dev` extra is for the tests).
#   gpu: the vllm engine, '.[vllm]' (vLLM with CUDA PyTorch); the host needs an NVIDIA driver
#       and the NVIDIA container toolkit.
# Nothing is fetched at run time: everything is installed here, models are local directories
# (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE) and vLLM sends no usage statistics.
# tests/test_compose.py checks these install lines against pyproject.toml and README.md.

FROM python:3.11-slim AS base
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1
# An unprivileged user; /models is its own so that a fresh named volume mounted there (compose's
# `models`) takes that ownership and model-init can write into it.
RUN useradd --create-home --uid 1000 rollouts && install -d -o rollouts -g rollouts /models
WORKDIR /app
COPY pyproject.toml README.md ./
COPY statemachine statemachine
COPY store store
COPY workers workers

FROM base AS gpu
# Triton (under vLLM) compiles its kernel launchers with a C compiler when they are first used.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN pip install '.[vllm]'
USER rollouts

FROM base AS cpu
# PyTorch's CPU build first: from PyPI, torch==2.13.0 is the CUDA build (a 527 MB wheel plus
# the CUDA 13 runtime). The `cpu` extra's torch==2.13.0 is then met by 2.13.0+cpu and kept.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install '.[cpu]' \
 && python -c "import torch; assert torch.version.cuda is None, 'a CUDA build of torch'"
USER rollouts
