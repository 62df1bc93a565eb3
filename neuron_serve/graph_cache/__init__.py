"""Persistent compiled-graph cache: keys (key.py) and storage (store.py). The runner
compiles and loads through it (model_runner/graphs.py, model_runner/background.py); the
`neuron-serve cache` command manages it (cli/cache.py)."""
