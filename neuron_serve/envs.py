"""Every environment variable neuron-serve reads, typed, parsed lazily, validated.

    from neuron_serve import envs
    envs.NEURON_SERVE_DEVICE        # parsed on first access, cached

A bad value raises ValueError naming the variable and the accepted values; it is never
silently replaced by a default.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    NEURON_SERVE_DEVICE: str
    NEURON_SERVE_BACKEND: str
    NEURON_SERVE_EMULATED_MEMORY_GB: float | None
    NEURON_SERVE_CACHE_DIR: str
    NEURON_SERVE_CACHE_MAX_GB: float | None
    NEURON_SERVE_COMPILE_MODE: str
    NEURON_SERVE_PROFILE_DIR: str
    NEURON_SERVE_KERNEL_DIR: str
    NEURON_SERVE_RANKS_ON_HOST: int


def _choice(name: str, default: str, choices: tuple[str, ...]) -> Callable[[], str]:
    def parse() -> str:
        value = os.environ.get(name, default).strip().lower() or default
        if value not in choices:
            raise ValueError(f"{name}={value!r} is not valid; use one of {list(choices)}")
        return value
    return parse


def _positive_float(name: str) -> Callable[[], float | None]:
    def parse() -> float | None:
        raw = os.environ.get(name, "").strip()
        if not raw:
            return None
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a number") from None
        if value <= 0:
            raise ValueError(f"{name}={raw!r} must be positive")
        return value
    return parse


def _positive_int(name: str, default: int) -> Callable[[], int]:
    def parse() -> int:
        raw = os.environ.get(name, "").strip()
        if not raw:
            return default
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"{name}={raw!r} must be a positive integer")
        return int(raw)
    return parse


def _under_cache_home(name: str, leaf: str) -> Callable[[], str]:
    """`name` if set, else $XDG_CACHE_HOME (or ~/.cache)/neuron-serve/`leaf`."""
    def parse() -> str:
        explicit = os.environ.get(name, "").strip()
        if explicit:
            return explicit
        home = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(home, "neuron-serve", leaf)
    return parse


_PARSERS: dict[str, Callable[[], Any]] = {
    # "neuron" activates the neuron platform in vLLM (same as `--device neuron`); set by
    # the plugin itself so that vLLM's child processes, whose argv differs, follow.
    "NEURON_SERVE_DEVICE": _choice("NEURON_SERVE_DEVICE", "", ("", "neuron")),
    # Which hardware backend the platform runs on: "auto" picks Trainium when torch_neuronx
    # imports and /dev/neuron* exists, else the CPU emulation; "neuron" or "emulated" force it.
    "NEURON_SERVE_BACKEND": _choice("NEURON_SERVE_BACKEND", "auto", ("auto", "neuron", "emulated")),
    # Memory (GiB) the emulated device reports as its capacity; default: a quarter of RAM.
    "NEURON_SERVE_EMULATED_MEMORY_GB": _positive_float("NEURON_SERVE_EMULATED_MEMORY_GB"),
    # Compiled-graph cache directory ("off" disables it); default under $XDG_CACHE_HOME.
    # The `neuron.cache_dir` key of --additional-config wins over it.
    "NEURON_SERVE_CACHE_DIR": _under_cache_home("NEURON_SERVE_CACHE_DIR", "graphs"),
    # Size cap of the compiled-graph cache in GB (least recently used entries go first).
    "NEURON_SERVE_CACHE_MAX_GB": _positive_float("NEURON_SERVE_CACHE_MAX_GB"),
    # ahead | background | eager (see neuron_serve.config); `neuron.compile_mode` wins.
    # Unset: the device's default.
    "NEURON_SERVE_COMPILE_MODE": _choice("NEURON_SERVE_COMPILE_MODE", "",
                                         ("", "ahead", "background", "eager")),
    # Where the emulated backend's C++ kernels are built, once per source and torch version.
    "NEURON_SERVE_KERNEL_DIR": _under_cache_home("NEURON_SERVE_KERNEL_DIR", "kernels"),
    # Where POST /admin/profile/stop writes traces and per-operator Parquet files;
    # `neuron-serve serve --profile-dir` wins.
    "NEURON_SERVE_PROFILE_DIR": _under_cache_home("NEURON_SERVE_PROFILE_DIR", "profiles"),
    # Set by the platform, read by its worker processes: the model ranks on this host
    # (tensor × local data parallel), which share the emulated device's cores and memory.
    "NEURON_SERVE_RANKS_ON_HOST": _positive_int("NEURON_SERVE_RANKS_ON_HOST", 1),
}
_cache: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    if name not in _PARSERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _cache:
        _cache[name] = _PARSERS[name]()
    return _cache[name]


def __dir__() -> list[str]:
    return sorted(_PARSERS)


def reset_cache() -> None:
    _cache.clear()


@contextlib.contextmanager
def override(**values: str) -> Iterator[None]:
    """Set variables for a block (tests); unknown names and bad values raise at once."""
    unknown = set(values) - set(_PARSERS)
    if unknown:
        raise ValueError(f"unknown neuron-serve variables {sorted(unknown)}; known: {sorted(_PARSERS)}")
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    reset_cache()
    try:
        for name in values:
            __getattr__(name)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        reset_cache()
