"""`POST /admin/profile/start|stop`: the workers of every data-parallel engine record the
serving steps with torch.profiler (neuron_serve.profiler); this side only tracks state and
reports files."""

from __future__ import annotations

import asyncio
from http import HTTPStatus

from vllm.engine.protocol import EngineClient

from neuron_serve.server.engines import per_engine
from neuron_serve.server.errors import ServerError
from neuron_serve.server.protocol import ProfileFiles, ProfileStarted, ProfileStopped


class ProfileControl:
    def __init__(self, engine: EngineClient, directory: str | None):
        self.engine, self.directory = engine, directory
        self.recording = False
        self._lock = asyncio.Lock()  # start and stop never interleave

    async def start(self) -> ProfileStarted:
        async with self._lock:
            if self.directory is None:
                raise ServerError("profiling is off: this server has no profile directory",
                                  HTTPStatus.CONFLICT)
            if self.recording:
                raise ServerError("a profile is already recording; POST /admin/profile/stop "
                                  "first", HTTPStatus.CONFLICT)
            await per_engine(self.engine, "start_step_profile", self.directory)
            self.recording = True
            return ProfileStarted(directory=self.directory)

    async def stop(self) -> ProfileStopped:
        async with self._lock:
            if not self.recording:
                raise ServerError("no profile is recording; POST /admin/profile/start first",
                                  HTTPStatus.CONFLICT)
            self.recording = False
            files = await per_engine(self.engine, "stop_step_profile")
            return ProfileStopped(files=[ProfileFiles(**f) for ranks in files.values()
                                         for f in ranks])
