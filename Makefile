# The README's two commands: `make serve` and `make test`. Both create .venv on first use.
PYTHON ?= python3.11
VENV   := .venv
READY  := $(VENV)/.neuron-serve-ready
HOST   ?= 127.0.0.1
PORT   ?= 8000
MODEL  ?=
ARGS   ?=
# `make serve` answers at once and compiles its graphs in the background (minutes on a
# 2-core CPU); COMPILE=ahead waits for every graph first, as `neuron-serve serve` does.
COMPILE ?= background

.PHONY: venv tools serve test clean

$(READY): pyproject.toml tools/setup_env.py
	$(PYTHON) tools/setup_env.py $(VENV)
	touch $@

venv: $(READY)

# Test tools with clashing pins (checkov) live in .tools/, outside .venv; reruns are no-ops.
tools:
	$(PYTHON) tools/setup_env.py --tools-only

serve: $(READY)
	$(VENV)/bin/neuron-serve serve $(MODEL) --host $(HOST) --port $(PORT) --compile-mode $(COMPILE) $(ARGS)

test: $(READY) tools
	$(VENV)/bin/python -m pytest $(ARGS)

clean:
	rm -rf $(VENV) .tools
