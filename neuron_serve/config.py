"""Settings of the neuron platform, validated once: buckets, block size, compile mode.

Read from vLLM's config and its `--additional-config '{"neuron": {...}}'` section:

    token_buckets    [int]  padded token counts of mixed (prefill + decode) steps
    request_buckets  [int]  padded request counts (decode steps use t = r)
    block_buckets    [int]  padded block-table widths (longest context, in blocks)
    max_attention_scratch_gb  float  cap on the attention gather of the largest bucket
    compile_mode     str    ahead: every graph compiled or loaded before ready;
                            background: ready at once, buckets run eager until their graph
                            is compiled by background processes; eager: never compile
                            (also what --enforce-eager selects). Default: the device's
                            (Device.default_compile_mode: background on the emulated
                            device, ahead on Trainium); ahead where the cache is off
    require_precompiled  bool  refuse to start unless the cache holds every graph
    cache_dir        str    compiled-graph cache directory, "off" to disable
                            (default: $NEURON_SERVE_CACHE_DIR or ~/.cache/neuron-serve/graphs)
    cache_max_gb     float  size cap of that cache, LRU-pruned (default 20)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from neuron_serve import buckets as bk

ADDITIONAL_CONFIG_KEY = "neuron"
_KNOWN_KEYS = {"token_buckets", "request_buckets", "block_buckets", "max_attention_scratch_gb",
               "compile_mode", "cache_dir", "cache_max_gb", "require_precompiled"}
COMPILE_MODES = ("ahead", "background", "eager")
DEFAULT_CACHE_MAX_GB = 20.0


@dataclass(frozen=True)
class NeuronConfig:
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    compile_mode: str
    token_buckets: tuple[int, ...] = ()
    request_buckets: tuple[int, ...] = ()
    block_buckets: tuple[int, ...] = ()
    max_attention_scratch_gb: float = 8.0
    cache_dir: str | None = None  # None: no persistent cache
    cache_max_gb: float = DEFAULT_CACHE_MAX_GB
    require_precompiled: bool = False
    grid: tuple[bk.Bucket, ...] = field(init=False)

    def __post_init__(self) -> None:
        def set_(name: str, value) -> None:  # the dataclass is frozen
            object.__setattr__(self, name, tuple(value))

        set_("token_buckets", self.token_buckets
             or bk.default_token_buckets(self.max_num_batched_tokens, self.max_num_seqs))
        set_("request_buckets", self.request_buckets or bk.default_request_buckets(self.max_num_seqs))
        set_("block_buckets", self.block_buckets or bk.default_block_buckets(self.max_blocks_per_seq))
        self._validate()
        set_("grid", bk.build_grid(list(self.token_buckets), list(self.request_buckets),
                                   list(self.block_buckets), self.max_num_seqs))

    @property
    def compile(self) -> bool:
        return self.compile_mode != "eager"

    @property
    def max_blocks_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    def _validate(self) -> None:
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"neuron.compile_mode={self.compile_mode!r} is not valid; use one "
                             f"of {list(COMPILE_MODES)}")
        if self.compile_mode == "background" and not self.cache_dir:
            raise ValueError("neuron.compile_mode='background' hands graphs over through the "
                             "compiled-graph cache, which is off: set neuron.cache_dir or "
                             "NEURON_SERVE_CACHE_DIR, or use compile_mode 'ahead'")
        if self.require_precompiled and (self.compile_mode != "ahead" or not self.cache_dir):
            raise ValueError("neuron.require_precompiled loads every graph from the cache "
                             "before serving: it needs the cache (neuron.cache_dir) and "
                             f"compile_mode 'ahead', not {self.compile_mode!r}")
        if not self.cache_max_gb > 0:
            raise ValueError(f"neuron.cache_max_gb must be positive, got {self.cache_max_gb}")
        for name in ("token_buckets", "request_buckets", "block_buckets"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"neuron.{name} must be a list of positive integers, got {list(values)}")
            if list(values) != sorted(set(values)):
                raise ValueError(f"neuron.{name} must be sorted and without duplicates, got {list(values)}")
        _need(self.token_buckets[-1] >= self.max_num_batched_tokens,
              f"the largest token bucket ({self.token_buckets[-1]}) is below "
              f"max_num_batched_tokens ({self.max_num_batched_tokens}), which one step may "
              "schedule: add a larger token bucket or lower --max-num-batched-tokens")
        _need(self.request_buckets[-1] >= self.max_num_seqs,
              f"the largest request bucket ({self.request_buckets[-1]}) is below max_num_seqs "
              f"({self.max_num_seqs}): add a larger request bucket or lower --max-num-seqs")
        _need(self.block_buckets[-1] >= self.max_blocks_per_seq,
              f"the largest block bucket ({self.block_buckets[-1]} blocks × {self.block_size} = "
              f"{self.block_buckets[-1] * self.block_size} tokens) cannot hold max_model_len "
              f"({self.max_model_len}): add a block bucket ≥ {self.max_blocks_per_seq} or lower "
              "--max-model-len")

    def attention_scratch_bytes(self, kv_shape: tuple[int, int, int]) -> int:
        """Peak gather of the reference kernel over the grid: a whole context per single
        token and per query tile, × b × block_size × KV heads × (K + V), in fp32."""
        num_kv_heads, head_size, dtype_bytes = kv_shape
        worst = max(self.grid, key=_gathered_blocks)
        return _gathered_blocks(worst) * self.block_size * num_kv_heads * 2 * head_size * max(dtype_bytes, 4)

    def check_attention_scratch(self, kv_shape: tuple[int, int, int]) -> None:
        scratch = self.attention_scratch_bytes(kv_shape)
        worst = max(self.grid, key=_gathered_blocks)
        _need(scratch <= self.max_attention_scratch_gb * 2**30,
              f"bucket {worst} needs {scratch / 2**30:.1f} GiB of attention scratch, above "
              f"neuron.max_attention_scratch_gb={self.max_attention_scratch_gb}: lower "
              "--max-model-len or --max-num-batched-tokens, or raise the cap")

    @classmethod
    def from_vllm_config(cls, vllm_config) -> NeuronConfig:
        extra: dict[str, Any] = dict((vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY) or {})
        unknown = set(extra) - _KNOWN_KEYS
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} in --additional-config "
                             f"'{ADDITIONAL_CONFIG_KEY}'; known: {sorted(_KNOWN_KEYS)}")
        from neuron_serve import envs

        sched = vllm_config.scheduler_config
        cache_dir = str(extra.get("cache_dir", envs.NEURON_SERVE_CACHE_DIR))
        cache_on = cache_dir.lower() not in ("off", "")
        strict = extra.get("require_precompiled", False)
        if not isinstance(strict, bool):
            raise ValueError(f"neuron.require_precompiled must be true or false, got {strict!r}")
        mode = extra.get("compile_mode") or envs.NEURON_SERVE_COMPILE_MODE or None
        if vllm_config.model_config.enforce_eager:
            mode = "eager"
        elif mode is None:
            mode = "ahead" if strict or not cache_on else _device_default_mode()
        return cls(
            block_size=vllm_config.cache_config.block_size,
            max_model_len=vllm_config.model_config.max_model_len,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            compile_mode=mode,
            require_precompiled=strict,
            cache_dir=cache_dir if cache_on else None,
            cache_max_gb=float(extra.get("cache_max_gb", envs.NEURON_SERVE_CACHE_MAX_GB
                                         or DEFAULT_CACHE_MAX_GB)),
            token_buckets=tuple(extra.get("token_buckets", ())),
            request_buckets=tuple(extra.get("request_buckets", ())),
            block_buckets=tuple(extra.get("block_buckets", ())),
            **({"max_attention_scratch_gb": float(extra["max_attention_scratch_gb"])}
               if "max_attention_scratch_gb" in extra else {}),
        )


def _device_default_mode() -> str:
    from neuron_serve import device

    return device.current().default_compile_mode


def _gathered_blocks(bucket: bk.Bucket) -> int:
    return (bucket.single_token_slots + bucket.num_tiles) * bucket.num_blocks


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"neuron-serve bucket config: {message}")
