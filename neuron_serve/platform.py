"""NeuronPlatform: what vLLM asks of a hardware backend, answered for Trainium/emulation."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

import torch
from vllm.platforms.interface import Platform, PlatformEnum
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from neuron_serve import device, envs, ray_cluster
from neuron_serve.attention import BACKEND_NAME, BACKEND_PATH
from neuron_serve.logs import init_logger
from neuron_serve.plugin import DEVICE

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

WORKER_PATH = "neuron_serve.worker.NeuronWorker"
DEFAULT_BLOCK_SIZE = 32

# Every process that resolves the platform imports this module: register our attention
# backend's name with vLLM here so that Attention layers can look it up.
if BACKEND_NAME not in AttentionBackendEnum.__members__:
    register_backend(BACKEND_NAME, BACKEND_PATH)

_DEVICE = device.current()
# validate_request() receives no config; check_and_update_config() records, per process,
# the longest context the bucket grid holds.
_context_limit: dict[str, int] = {}


def _device_choice(value: str) -> str:
    if value != DEVICE:
        raise argparse.ArgumentTypeError(
            f"--device {value!r}: neuron-serve's platform serves only '--device {DEVICE}'. "
            "Drop --device to let vLLM pick its own platform (VLLM_TARGET_DEVICE=cpu for its "
            "CPU backend).")
    return value


def _spawn_workers() -> None:
    """A forked child of a process whose OpenMP pool is running deadlocks in its first torch
    op (seen: engine core hanging while building RoPE tables): vLLM must spawn."""
    if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") != "spawn":
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        logger.info("VLLM_WORKER_MULTIPROC_METHOD=spawn: a forked engine process can deadlock "
                    "in its first torch op")


def _check_parallel(parallel) -> None:
    """Tensor and data parallel are served; the other kinds are refused by name. The
    workers learn how many model ranks share this host (the emulated device divides its
    cores and memory between them) from the environment they inherit: inside an engine,
    vLLM has already reduced the data-parallel size to the engine's own."""
    refused = {"--pipeline-parallel-size": parallel.pipeline_parallel_size,
               "--decode-context-parallel-size": parallel.decode_context_parallel_size,
               "--prefill-context-parallel-size": parallel.prefill_context_parallel_size}
    for flag, size in refused.items():
        if size > 1:
            raise NotImplementedError(
                f"{flag} {size}: the neuron platform shards a model by tensor parallel "
                "(--tensor-parallel-size) and replicates it by data parallel "
                "(--data-parallel-size); pipeline and context parallel are not supported")
    ranks = parallel.tensor_parallel_size * parallel.data_parallel_size_local
    if ranks:  # none on an API-only node (--data-parallel-size-local 0)
        os.environ["NEURON_SERVE_RANKS_ON_HOST"] = str(ranks)
        envs.reset_cache()


class NeuronPlatform(Platform):
    _enum = PlatformEnum.OOT
    # Weight formats our devices' linear kernels read (--quantization, or a checkpoint's);
    # a device's own methods join when registered (neuron_serve.register_general).
    supported_quantization: list[str] = ["fp8", "fp8_per_tensor", "fp8_per_channel",
                                         "compressed-tensors"]
    device_name: str = _DEVICE.torch_device.type
    device_type: str = _DEVICE.torch_device.type
    dispatch_key: str = _DEVICE.dispatch_key
    dist_backend: str = _DEVICE.dist_backend
    simple_compile_backend: str = _DEVICE.compile_backend
    ray_device_key: str = ray_cluster.RESOURCE

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        if _DEVICE.native_bf16:
            return [torch.bfloat16, torch.float16, torch.float32]
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return f"neuron-{_DEVICE.backend}"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return _DEVICE.total_memory_bytes()

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        import psutil
        return float(psutil.Process().memory_info().rss)

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        pass  # one device per process; nothing to select

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.manual_seed(seed)

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def import_kernels(cls) -> None:
        _DEVICE.import_vllm_kernels()

    @classmethod
    def verify_quantization(cls, quant: str) -> None:
        super().verify_quantization(quant)
        _DEVICE.accept_quantization(quant)

    @classmethod
    def opaque_attention_op(cls) -> bool:
        # Attention is traced into each bucket's graph; its metadata is persistent per bucket.
        return False

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False  # sliding-window layers share the full cache; the kernel masks the window

    @classmethod
    def update_block_size_for_backend(cls, vllm_config: VllmConfig) -> None:
        pass  # check_and_update_config chose it; the runner's buckets are sized from it

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        cfg = attn_selector_config
        unsupported = {"MLA": cfg.use_mla, "sparse attention": cfg.use_sparse,
                       "attention sinks": cfg.has_sink}
        names = [name for name, used in unsupported.items() if used]
        if names:
            raise NotImplementedError(f"neuron-serve does not support {', '.join(names)}")
        if selected_backend is not None and selected_backend.name != BACKEND_NAME:
            logger.warning("attention backend %s ignored: the neuron platform uses %s",
                           selected_backend.name, BACKEND_NAME)
        return BACKEND_PATH

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        if parser is not None and "--device" not in parser._option_string_actions:
            parser.add_argument("--device", type=_device_choice, default=DEVICE,
                                help="Hardware to serve on. neuron-serve's platform: 'neuron' "
                                     "(Trainium, or its CPU emulation without Trainium). Its "
                                     "compile mode (neuron.compile_mode in --additional-config) "
                                     "defaults to the device's: background on the emulation "
                                     "(answers at once, compiles meanwhile), ahead on Trainium "
                                     "(every graph first, from a cache `neuron-serve compile` "
                                     "filled).")

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        from vllm.config import CompilationMode, CUDAGraphMode

        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER_PATH
        _check_parallel(parallel)
        if parallel.use_ray:
            ray_cluster.carry_settings(parallel)
        cache = vllm_config.cache_config
        if not cache.user_specified_block_size:
            cache.block_size = DEFAULT_BLOCK_SIZE
        # We compile one graph per bucket ourselves; vLLM's own compilation stays off.
        compilation = vllm_config.compilation_config
        compilation.mode = CompilationMode.NONE
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        compilation.cudagraph_capture_sizes = []
        # vLLM IR ops (RMSNorm, ...) straight to their implementations, so our graphs trace
        # through them instead of calling an opaque op that runs eagerly.
        compilation.ir_enable_torch_wrap = False
        vllm_config.scheduler_config.async_scheduling = False
        _spawn_workers()
        model = vllm_config.model_config
        if model is None:  # vLLM also calls this with partial configs
            return
        model.dtype = _DEVICE.compute_dtype(model.dtype)
        if vllm_config.speculative_config is not None or vllm_config.lora_config is not None:
            raise NotImplementedError("neuron-serve supports neither speculative decoding nor LoRA")
        from neuron_serve.config import NeuronConfig
        neuron = NeuronConfig.from_vllm_config(vllm_config)  # raises on a bad bucket config
        _context_limit["tokens"] = min(model.max_model_len, neuron.block_buckets[-1] * cache.block_size)
        logger.info("neuron platform (%s): %d buckets, block size %d, dtype %s",
                    _DEVICE.backend, len(neuron.grid), cache.block_size, model.dtype)

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        """A refused request is vLLM's client error: 400 on either server, not 500."""
        from vllm.exceptions import VLLMValidationError

        kind = processed_inputs.get("type")
        if kind != "token":
            raise VLLMValidationError(f"neuron-serve accepts token prompts only, not {kind!r} inputs",
                                      parameter="prompt")
        limit = _context_limit.get("tokens")
        prompt_len = len(processed_inputs["prompt_token_ids"])
        if limit is not None and prompt_len >= limit:
            raise VLLMValidationError(
                f"prompt of {prompt_len} tokens does not fit: the largest context bucket holds "
                f"{limit} tokens including at least one generated token; shorten the prompt "
                "or serve with a larger --max-model-len / neuron.block_buckets", parameter="prompt")
