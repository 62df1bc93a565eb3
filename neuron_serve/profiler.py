"""Profiling the serving steps: a torch.profiler trace plus per-operator metrics as Parquet.

Runs inside the engine's worker (started and stopped over collective RPC from
`POST /admin/profile/start|stop`), so it records exactly the steps that serve requests.
"""

from __future__ import annotations

import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

OPERATOR_COLUMNS = ("name", "calls", "self_cpu_us", "total_cpu_us", "input_shapes")


class StepProfiler:
    def __init__(self, name: str):
        self.name = name  # unique among the host's workers: part of the file names
        self._profile: profile | None = None
        self._out: Path | None = None

    @property
    def recording(self) -> bool:
        return self._profile is not None

    def start(self, directory: str) -> None:
        if self.recording:
            raise RuntimeError("a profile is already recording; stop it first")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self._out = Path(directory) / f"profile-{stamp}-{self.name}"
        self._out.parent.mkdir(parents=True, exist_ok=True)
        self._profile = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        self._profile.__enter__()

    def stop(self) -> dict[str, str]:
        """Write `<name>.trace.json` (chrome://tracing, Perfetto) and `<name>.operators.parquet`
        next to it; returns both paths."""
        if not self.recording:
            raise RuntimeError("no profile is recording; start one first")
        prof, out = self._profile, self._out
        self._profile = self._out = None
        prof.__exit__(None, None, None)
        trace, table = Path(f"{out}.trace.json"), Path(f"{out}.operators.parquet")
        prof.export_chrome_trace(str(trace))
        write_operator_table(prof, table)
        return {"trace": str(trace), "operators": str(table)}


def write_operator_table(prof: profile, path: Path) -> None:
    """One row per (operator, input shapes): calls and self/total CPU microseconds."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = sorted(prof.key_averages(group_by_input_shape=True),
                  key=lambda e: e.self_cpu_time_total, reverse=True)
    table = pa.table({
        "name": [e.key for e in rows],
        "calls": pa.array([e.count for e in rows], pa.int64()),
        "self_cpu_us": pa.array([float(e.self_cpu_time_total) for e in rows], pa.float64()),
        "total_cpu_us": pa.array([float(e.cpu_time_total) for e in rows], pa.float64()),
        "input_shapes": [str(e.input_shapes) for e in rows],
    })
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)  # never a half-written file under the final name

