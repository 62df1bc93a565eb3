"""The on-disk compiled-graph cache: one file per graph, one readable manifest.

    <root>/manifest.json        what each entry is: bucket, size, compile seconds, dates,
                                versions, checksum, and the full key it was compiled for
    <root>/graphs/<digest>.bin  the serialized graph
    <root>/locks/               cross-process locks (fcntl; released if a process dies)
    <root>/inductor/            the emulated backend's build cache (compiled kernels)

Every write is temp file + rename, so a crash leaves the old state or the new one, never
half of either; a killed writer's temp file (named with its pid) is removed by the next
process that opens the cache. A graph whose checksum, size or versions disagree with the manifest is
evicted with a warning and reported as a miss: the caller recompiles it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import hashlib
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from neuron_serve.logs import init_logger

logger = init_logger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class GraphKey:
    """What a graph was compiled for. `fields` is everything that shapes the graph and
    nothing else (weights are not in it); `digest` names the entry."""
    fields: dict

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.fields, sort_keys=True).encode()).hexdigest()[:32]

    @property
    def label(self) -> str:
        return self.fields.get("label", self.digest)


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _remove_orphaned_temp_files(directory: Path) -> None:
    """Temp files of `_atomic_write` whose writer process is gone."""
    for tmp in directory.glob(".*.tmp"):
        try:
            pid = int(tmp.name.rsplit(".", 3)[-3])
            os.kill(pid, 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except (ValueError, IndexError, PermissionError):
            pass  # not ours, or a live process of another user


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


class GraphCache:
    def __init__(self, root: str | os.PathLike, max_bytes: int | None = None):
        self.root = Path(root).expanduser().resolve()
        self.max_bytes = max_bytes
        for sub in ("graphs", "locks", "inductor"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for directory in (self.root, self.root / "graphs"):
            _remove_orphaned_temp_files(directory)

    @property
    def inductor_dir(self) -> Path:
        return self.root / "inductor"

    def graph_path(self, digest: str) -> Path:
        return self.root / "graphs" / f"{digest}.bin"

    # ---- locks -----------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self, name: str, blocking: bool = True) -> Iterator[bool]:
        """Exclusive cross-process lock; yields False if `blocking` is off and it is held."""
        with open(self.root / "locks" / f"{name}.lock", "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # ---- manifest --------------------------------------------------------------------

    def entries(self) -> dict[str, dict]:
        path = self.root / MANIFEST
        if not path.exists():
            return {}
        try:
            manifest = json.loads(path.read_text())
            if manifest.get("format") != FORMAT:
                raise ValueError(f"manifest format {manifest.get('format')!r}, expected {FORMAT}")
            return dict(manifest["entries"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("graph cache manifest %s is unreadable (%s); treating the cache "
                           "as empty, entries will be rebuilt", path, e)
            return {}

    @contextlib.contextmanager
    def _editing_manifest(self) -> Iterator[dict[str, dict]]:
        with self.lock("manifest"):
            entries = self.entries()
            yield entries
            body = {"format": FORMAT, "entries": entries}
            _atomic_write(self.root / MANIFEST, json.dumps(body, indent=1, sort_keys=True).encode())

    # ---- entries ---------------------------------------------------------------------

    def _read(self, digest: str, entry: dict | None,
              fields: dict | None = None) -> tuple[bytes | None, str | None]:
        """The entry's bytes, and why it cannot be used (None if it can)."""
        if entry is None:
            return None, "not in the manifest"
        if fields is not None and entry.get("versions") != fields.get("versions"):
            return None, f"built by {entry.get('versions')}, running {fields.get('versions')}"
        try:
            data = self.graph_path(digest).read_bytes()
        except FileNotFoundError:
            return None, "graph file missing"
        if len(data) != entry.get("bytes"):
            return None, f"size {len(data)} B, manifest says {entry.get('bytes')} B (truncated?)"
        if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            return None, "checksum mismatch"
        return data, None

    def problem(self, digest: str, entry: dict | None) -> str | None:
        return self._read(digest, entry)[1]

    def has(self, key: GraphKey) -> bool:
        """Whether the manifest lists a graph for `key` built by these versions (its bytes
        are checked when it is loaded)."""
        entry = self.entries().get(key.digest)
        return entry is not None and entry.get("versions") == key.fields.get("versions")

    def load(self, key: GraphKey) -> bytes | None:
        """The graph's bytes if a valid entry exists; an invalid one is evicted (warning).
        A graph file without a manifest entry is a write in progress: a miss, left alone."""
        digest = key.digest
        entry = self.entries().get(digest)
        if entry is None:
            return None
        data, problem = self._read(digest, entry, key.fields)
        if problem:
            self.evict(digest, problem)
            return None
        with self._editing_manifest() as entries:
            if digest in entries:
                entries[digest]["last_used"] = _now()
        return data

    def store(self, key: GraphKey, data: bytes, compile_seconds: float) -> None:
        digest = key.digest
        _atomic_write(self.graph_path(digest), data)
        with self._editing_manifest() as entries:
            entries[digest] = {
                "label": key.label, "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "compile_seconds": round(compile_seconds, 2),
                "created": _now(), "last_used": _now(),
                "versions": key.fields.get("versions"), "key": key.fields,
            }
        if self.max_bytes is not None:
            self.prune(self.max_bytes, keep={digest})

    def evict(self, digest: str, reason: str) -> None:
        logger.warning("graph cache: evicting %s (%s); it will be rebuilt", digest, reason)
        self.remove(digest)

    def remove(self, digest: str) -> None:
        with self._editing_manifest() as entries:
            entries.pop(digest, None)
            with contextlib.suppress(FileNotFoundError):
                self.graph_path(digest).unlink()

    # ---- maintenance -----------------------------------------------------------------

    def size_bytes(self) -> int:
        return _dir_bytes(self.root / "graphs") + _dir_bytes(self.inductor_dir)

    def verify(self) -> dict[str, str | None]:
        """Problem (or None) for every entry and every graph file the manifest lacks;
        problems are evicted."""
        entries = self.entries()
        digests = set(entries) | {p.stem for p in (self.root / "graphs").glob("*.bin")}
        report = {d: self.problem(d, entries.get(d)) for d in sorted(digests)}
        for digest, problem in report.items():
            if problem:
                self.evict(digest, problem)
        return report

    def prune(self, max_bytes: int, keep: set[str] = frozenset()) -> list[str]:
        """Evict least-recently-used entries until the cache fits in `max_bytes`. The kernel
        build cache is dropped too if entries alone do not get there (it only speeds up
        loading and is rebuilt from the entries)."""
        removed = []
        by_age = sorted(self.entries().items(), key=lambda kv: kv[1].get("last_used", ""))
        for digest, _ in by_age:
            if self.size_bytes() <= max_bytes:
                break
            if digest not in keep:
                self.remove(digest)
                removed.append(digest)
        if self.size_bytes() > max_bytes and _dir_bytes(self.inductor_dir):
            shutil.rmtree(self.inductor_dir, ignore_errors=True)
            self.inductor_dir.mkdir()
        if removed:
            logger.info("graph cache: pruned %d least-recently-used entries to fit %.1f MB",
                        len(removed), max_bytes / 1e6)
        return removed

    def export(self, archive: str | os.PathLike) -> int:
        """Write every valid entry (and the kernel build cache) into one .tar.gz."""
        self.verify()
        archive = Path(archive)
        tmp = archive.with_name(f".{archive.name}.tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            for name in (MANIFEST, "graphs", "inductor"):
                if (self.root / name).exists():
                    tar.add(self.root / name, arcname=name)
        os.replace(tmp, archive)
        return len(self.entries())

    def import_(self, archive: str | os.PathLike) -> int:
        """Merge an exported archive; entries are checked before they are added."""
        with tempfile.TemporaryDirectory(dir=self.root) as tmp:
            with tarfile.open(archive, "r:gz") as tar:
                tar.extractall(tmp, filter="data")
            other = GraphCache(tmp)
            incoming = {d: e for d, e in other.entries().items() if not other.problem(d, e)}
            for digest in incoming:
                _atomic_write(self.graph_path(digest), other.graph_path(digest).read_bytes())
            shutil.copytree(other.inductor_dir, self.inductor_dir, dirs_exist_ok=True)
            with self._editing_manifest() as entries:
                entries.update(incoming)
        return len(incoming)
