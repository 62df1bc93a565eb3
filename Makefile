# The README's two commands: `make serve` and `make test`. Both create .venv on first use.
PYTHON ?= python3.11
VENV   := .venv
READY  := $(VENV)/.neuron-serve-ready
HOST   ?= 127.0.0.1
PORT   ?= 8000
MODEL  ?=
ARGS   ?=
# Empty: the device's compile mode (background on the CPU emulation: answers at once and
# compiles its graphs meanwhile); COMPILE=ahead waits for every graph first.
COMPILE ?=

.PHONY: venv tools serve lint test test-fast clean

$(READY): pyproject.toml tools/setup_env.py
	$(PYTHON) tools/setup_env.py $(VENV)
	touch $@

venv: $(READY)

# Test tools with clashing pins (checkov) live in .tools/, outside .venv; reruns are no-ops.
tools:
	$(PYTHON) tools/setup_env.py --tools-only

serve: $(READY)
	$(VENV)/bin/neuron-serve serve $(MODEL) --host $(HOST) --port $(PORT) $(if $(COMPILE),--compile-mode $(COMPILE)) $(ARGS)

lint: $(READY)
	$(VENV)/bin/ruff check .

# Every tier (tests/unit, tests/engine, tests/e2e) after the linter: CI's command.
test: $(READY) tools lint
	$(VENV)/bin/python -m pytest $(ARGS)

# The unit tier alone: no subprocess, no compile, under 2 minutes.
test-fast: $(READY) lint
	$(VENV)/bin/python -m pytest tests/unit $(ARGS)

clean:
	rm -rf $(VENV) .tools
