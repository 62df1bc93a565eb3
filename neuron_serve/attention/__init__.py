"""Paged attention for the neuron platform: vLLM backend (backend.py), the attention layer's
forward (layer.py), reference kernels and the kernel-set registry (kernels.py)."""

BACKEND_NAME = "NEURON_PAGED_ATTN"
BACKEND_PATH = "neuron_serve.attention.backend.NeuronAttentionBackend"
