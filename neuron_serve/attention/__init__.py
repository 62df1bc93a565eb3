"""Paged attention for the neuron platform: vLLM backend (backend.py), kernels (kernels.py)."""

BACKEND_NAME = "NEURON_PAGED_ATTN"
BACKEND_PATH = "neuron_serve.attention.backend.NeuronAttentionBackend"
