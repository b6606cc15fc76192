# Image for compose.yaml's worker: the project with the CPU engine. For GPU nodes, install the
# `vllm` extra on a CUDA base image instead.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY statemachine statemachine
COPY store store
COPY workers workers
RUN pip install --no-cache-dir '.[cpu]'
ENV HF_HUB_OFFLINE=1
ENTRYPOINT []
