# tpflex — development tasks. `make help` lists them.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip
STAMP := $(VENV)/.tpflex-installed
PROTO_SRC := $(wildcard proto/tpflex_proto/*.proto)
PROTO_OUT := proto/tpflex_proto/types_pb2.py
PYPROJECTS := proto/pyproject.toml controller/pyproject.toml agent/pyproject.toml trainer_hooks/pyproject.toml cli/pyproject.toml tests/requirements.txt constraints.txt
CHROMIUM := /usr/bin/chromium
FAKE_NVML := agent/fake_nvml/build/libnvidia-ml.so.1
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help install proto test demo bench lint fake-nvml clean screenshot

DIST ?= dist
COMPONENTS := proto controller agent trainer_hooks cli

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

install: $(STAMP) $(PROTO_OUT) ## install etcd-server, prometheus, chromium (apt), the venv and every component (idempotent)

$(STAMP): $(PYPROJECTS)
	@{ command -v etcd && command -v promtool && test -x $(CHROMIUM); } >/dev/null || { \
	  echo "installing Debian's etcd-server, prometheus (promtool) and chromium (tests/ui)"; \
	  SUDO=$$( [ $$(id -u) -eq 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	    etcd-server prometheus chromium >/dev/null; }
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@# one resolution for everything; --no-compile: no byte-compiling of every installed
	@# file (torch's thousands): Python compiles what is imported, once, on first import
	$(PIP) install -q --no-compile -c constraints.txt torch -r tests/requirements.txt \
	  -e 'proto[rpc,etcd,dev]' -e 'controller[sim]' -e agent -e 'trainer_hooks[demo]' -e cli
	@# a venv from before tpflex-cli (cli/): uninstalling the old controller, whose RECORD
	@# lists bin/tpflexctl, can remove the script tpflex-cli wrote earlier in the same run
	@test -x $(BIN)/tpflexctl || $(PIP) install -q --no-compile --no-deps --force-reinstall -e cli
	@touch $@

proto: $(PROTO_OUT) ## generate protobuf/gRPC code from proto/tpflex_proto/*.proto

$(PROTO_OUT): $(PROTO_SRC) | $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=proto --pyi_out=proto \
	  --grpc_python_out=proto $(PROTO_SRC)
	@touch $@

.PHONY: dist
dist: $(PROTO_OUT) ## build one wheel per component (proto, controller, agent, trainer_hooks, cli) into dist/
	rm -rf $(DIST) $(addsuffix /build,$(COMPONENTS))
	$(PIP) wheel -q --no-deps --no-build-isolation -w $(DIST) $(addprefix ./,$(COMPONENTS))
	rm -rf $(addsuffix /build,$(COMPONENTS))
	@ls -1 $(DIST)

.PHONY: certs
certs: ## development CA and TLS certificates in .certs/ (idempotent; TPFLEX_CERT_SANS adds SANs)
	deploy/certs/make-dev-certs.sh .certs

fake-nvml: $(FAKE_NVML) ## build the fake libnvidia-ml.so.1 used by the NVML backend tests

$(FAKE_NVML): $(wildcard agent/fake_nvml/*.c agent/fake_nvml/*.h)
	@mkdir -p $(dir $@)
	gcc -shared -fPIC -O2 -Wall -Wextra -o $@ agent/fake_nvml/fake_nvml.c -lpthread

test: install fake-nvml ## run the whole test suite (real etcd, gRPC, uvicorn, gloo)
	@# bytecode writing on: install skips byte-compiling (--no-compile) and counts on Python
	@# compiling what is imported, once. With PYTHONDONTWRITEBYTECODE set by the caller
	@# (this machine's shells) nothing is ever cached, and every process a test starts
	@# compiles torch again (~3 s of CPU per rank; ~9 s with transformers)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest -c tests/pytest.ini tests $(PYTEST_ARGS)

demo: install ## run the end-to-end demo: fail a GPU, re-plan, reshard, repair
	$(BIN)/tpflex-demo

BENCH_ARGS ?=
bench: install fake-nvml ## run every benchmark in bench/ (one JSON line each; BENCH_ARGS=--quick for the quick modes)
	@for b in bench/*.py; do \
	  grep -q '__main__' $$b || continue; \
	  case $$b in bench/lease_keeper.py|bench/rest_clients.py) continue;; esac; \
	  echo "# $$b" >&2; PYTHONPATH=. $(BIN)/python $$b $(BENCH_ARGS) || exit 1; done

screenshot: install ## the console screenshot of the README and docs/console.md (docs/img/console.png)
	PYTHONPATH=. $(BIN)/python -m tests.ui.screenshot docs/img/console.png

lint: install ## ruff and the import contracts (.importlinter; both pinned in tests/requirements.txt); .ci/run runs it before the tests
	$(BIN)/ruff check --line-length 100 --target-version py311 \
	  --select E,F,W,I,B,UP --ignore E501,B008 --exclude '*_pb2*.py' \
	  proto controller agent trainer_hooks cli tests bench
	$(BIN)/lint-imports --config .importlinter --no-cache

clean: ## remove the venv, generated code and build outputs
	rm -rf $(VENV) proto/tpflex_proto/*_pb2*.py proto/tpflex_proto/*_pb2.pyi agent/fake_nvml/build
