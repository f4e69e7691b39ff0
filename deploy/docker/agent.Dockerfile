# syntax=docker/dockerfile:1
# tpflex/agent: tpflex-agent in a virtualenv, plus the pod's gRPC readiness probe. NVML
# (libnvidia-ml.so.1) and /dev/nvidia* come from the host through the NVIDIA container
# runtime (runtimeClassName: nvidia, NVIDIA_DRIVER_CAPABILITIES=utility); the image holds
# no driver. Runs as root with CAP_SYS_ADMIN only (deploy/kubernetes/30-agent.yaml).
# Build from the repository root, after `make dist`:
#   make dist
#   docker build -f deploy/docker/agent.Dockerfile -t tpflex/agent:0.1.0 .
FROM python:3.11.13-slim-bookworm

COPY constraints.txt /tmp/tpflex/constraints.txt
COPY dist/tpflex_proto-*.whl dist/tpflex_agent-*.whl /tmp/tpflex/wheels/
RUN python -m venv /opt/tpflex/venv \
    && /opt/tpflex/venv/bin/pip install --no-cache-dir -c /tmp/tpflex/constraints.txt /tmp/tpflex/wheels/*.whl \
    && rm -rf /tmp/tpflex
# readiness: grpc.health.v1 over the agent's mutual TLS (Kubernetes' grpc probe has no TLS)
COPY deploy/docker/grpc-health-probe.py /opt/tpflex/bin/grpc-health-probe

ENV PATH=/opt/tpflex/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility
# 8472 gRPC (mutual TLS), 8473 /metrics (HTTPS)
EXPOSE 8472 8473
ENTRYPOINT ["tpflex-agent"]
CMD ["--config", "/etc/tpflex/config/agent.toml"]
