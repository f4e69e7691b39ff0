# syntax=docker/dockerfile:1
# tpflex/controller: tpflex-controller in a virtualenv, as user 10001 (tpflexctl is its own
# wheel, tpflex_cli-*.whl: operators install it where they run it, docs/deploy.md).
# Build from the repository root, after `make dist` put the wheels into dist/:
#   make dist
#   docker build -f deploy/docker/controller.Dockerfile -t tpflex/controller:0.1.0 .
# (BuildKit reads controller.Dockerfile.dockerignore: only dist/ and constraints.txt are
# sent.) docs/deploy.md, "Container images".
FROM python:3.11.13-slim-bookworm

# the wheels by path (never a same-named package from an index), their dependencies
# from the index at the versions the test suite ran
COPY constraints.txt /tmp/tpflex/constraints.txt
COPY dist/tpflex_proto-*.whl dist/tpflex_controller-*.whl /tmp/tpflex/wheels/
RUN python -m venv /opt/tpflex/venv \
    && /opt/tpflex/venv/bin/pip install --no-cache-dir -c /tmp/tpflex/constraints.txt /tmp/tpflex/wheels/*.whl \
    && rm -rf /tmp/tpflex \
    && groupadd --system --gid 10001 tpflex \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tpflex

# the controller's unit sets the same malloc tuning (docs/deploy.md, section 4)
ENV PATH=/opt/tpflex/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    MALLOC_ARENA_MAX=2 \
    MALLOC_MMAP_THRESHOLD_=262144
USER 10001:10001
# 8470 REST + /metrics (HTTPS), 8471 trainer gRPC (TLS)
EXPOSE 8470 8471
ENTRYPOINT ["tpflex-controller"]
CMD ["--config", "/etc/tpflex/config/controller.toml"]
