"""Worker RPCs on every data-parallel engine behind one endpoint."""

from __future__ import annotations


async def per_engine(engine, method: str, *args) -> dict[str, list]:
    """A worker RPC on every data-parallel engine: {engine index: one result per rank}.
    (vLLM's `collective_rpc` reaches the first engine only.)"""
    core = engine.engine_core
    results = await core.call_utility_all_async("collective_rpc", method, None, args, None)
    return {str(int.from_bytes(e, "little")): r for e, r in zip(core.core_engines, results)}
