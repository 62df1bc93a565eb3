# The README's two commands: `make serve` and `make test`. Both create .venv on first use.
PYTHON ?= python3.11
VENV   := .venv
READY  := $(VENV)/.neuron-serve-ready
HOST   ?= 127.0.0.1
PORT   ?= 8000
MODEL  ?=
ARGS   ?=

.PHONY: venv serve test clean

$(READY): pyproject.toml tools/setup_env.py
	$(PYTHON) tools/setup_env.py $(VENV)
	touch $@

venv: $(READY)

serve: $(READY)
	$(VENV)/bin/neuron-serve serve $(MODEL) --host $(HOST) --port $(PORT) $(ARGS)

test: $(READY)
	$(VENV)/bin/python -m pytest $(ARGS)

clean:
	rm -rf $(VENV)
