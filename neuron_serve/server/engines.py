"""Worker RPCs on every data-parallel engine behind one endpoint."""

from __future__ import annotations

import asyncio


async def per_engine(engine, method: str, *args) -> dict[str, list]:
    """A worker RPC on every data-parallel engine: {engine index: one result per rank}.
    (vLLM's `collective_rpc` reaches the first engine only.)"""
    core = engine.engine_core
    results = await core.call_utility_all_async("collective_rpc", method, None, args, None)
    return {str(int.from_bytes(e, "little")): r for e, r in zip(core.core_engines, results)}


class EngineWatch:
    """Asks every data-parallel engine for a no-op answer every `period_s`; one that has not
    answered within `timeout_s` is lost. vLLM watches only the engine processes of its own
    node: without this, a head whose headless node vanished stays healthy and routes
    requests to an engine that will never answer."""

    def __init__(self, engine, period_s: float = 5.0, timeout_s: float = 30.0):
        self.engine, self.period_s, self.timeout_s = engine, period_s, timeout_s
        self.lost: str | None = None

    async def run(self) -> None:
        core = self.engine.engine_core
        while True:
            try:
                await asyncio.wait_for(core.call_utility_all_async("is_sleeping"), self.timeout_s)
            except TimeoutError:
                self.lost = (f"a data-parallel engine has not answered for {self.timeout_s:g} s "
                             "(its node is gone?)")
                return
            except Exception:  # noqa: BLE001 - a dead engine: vLLM's client reports it
                return
            await asyncio.sleep(self.period_s)
