"""The model runner: vLLM's scheduler output in, one padded step in a static-shape bucket
out, on one compiled graph per bucket (runner.py; buckets in neuron_serve.buckets)."""
