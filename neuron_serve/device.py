"""The only module that knows whether we run on Trainium (`neuron`) or emulate it on CPU.

(Grows with the platform: torch device, compile backend, memory, kernel choice.)
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger(__name__)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True if the CPU computes bf16 natively (AVX512-BF16 or AMX); else bf16 is emulated."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@functools.cache
def emulated_compute_dtype() -> str:
    """fp32 on CPUs without native bf16, where bf16 matmul runs ~200x slower (DESIGN §3)."""
    dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    logger.info("emulated backend computes in %s (native bf16: %s)", dtype, cpu_has_native_bf16())
    return dtype
