# syntax=docker/dockerfile:1
# tpflex/trainer: tpflex-run (the node launcher) and the trainer hooks, with torch, for
# the training pods (deploy/kubernetes/40-training-job.yaml). The torch wheel from PyPI
# brings its CUDA libraries; the driver comes from the host (NVIDIA container runtime).
# Training code: build FROM this image and COPY your script, or install the trainer
# wheel into your own image (NGC, Megatron) instead: it needs only torch >= 2.4.
# Build from the repository root, after `make dist`:
#   make dist
#   docker build -f deploy/docker/trainer.Dockerfile -t tpflex/trainer:0.1.0 .
# TORCH_INDEX_URL selects another torch build (e.g. https://download.pytorch.org/whl/cu128).
FROM python:3.11.13-slim-bookworm

ARG TORCH_INDEX_URL=https://pypi.org/simple
COPY constraints.txt /tmp/tpflex/constraints.txt
COPY dist/tpflex_proto-*.whl dist/tpflex_trainer-*.whl /tmp/tpflex/wheels/
RUN python -m venv /opt/tpflex/venv \
    && /opt/tpflex/venv/bin/pip install --no-cache-dir -c /tmp/tpflex/constraints.txt \
        --extra-index-url "$TORCH_INDEX_URL" /tmp/tpflex/wheels/*.whl \
    && rm -rf /tmp/tpflex

ENV PATH=/opt/tpflex/venv/bin:$PATH \
    PYTHONUNBUFFERED=1
ENTRYPOINT ["tpflex-run"]
