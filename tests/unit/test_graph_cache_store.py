"""The compiled-graph cache on disk, without an engine: manifest, checksums, eviction,
locks, LRU pruning, export/import, and what the key does and does not cover."""

import json
import time
from types import SimpleNamespace

import pytest

from neuron_serve.buckets import Bucket
from neuron_serve.graph_cache.key import graph_key, versions
from neuron_serve.graph_cache.store import GraphCache, GraphKey


def key(n: int, **fields) -> GraphKey:
    return GraphKey({"label": f"graph {n}", "n": n, "versions": versions(), **fields})


@pytest.fixture
def cache(tmp_path) -> GraphCache:
    return GraphCache(tmp_path / "cache")


def test_stored_graph_loads_back_and_the_manifest_reads_like_a_table(cache):
    cache.store(key(1), b"graph-bytes" * 100, compile_seconds=12.345)
    assert cache.load(key(1)) == b"graph-bytes" * 100
    assert cache.load(key(2)) is None
    manifest = json.loads((cache.root / "manifest.json").read_text())
    entry = manifest["entries"][key(1).digest]
    assert entry["label"] == "graph 1" and entry["bytes"] == 1100
    assert entry["compile_seconds"] == 12.35
    assert entry["created"] <= entry["last_used"]
    assert not list((cache.root / "graphs").glob(".*tmp"))  # no temp file left behind


def _truncate(cache, k):
    path = cache.graph_path(k.digest)
    path.write_bytes(path.read_bytes()[:10])


def _garble(cache, k):
    path = cache.graph_path(k.digest)
    path.write_bytes(bytes(b ^ 0x5A for b in path.read_bytes()))


def _wrong_version(cache, k):
    path = cache.root / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["entries"][k.digest]["versions"]["torch"] = "0.0.1"
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("corrupt", [_truncate, _garble, _wrong_version])
def test_a_corrupt_entry_is_a_miss_and_is_evicted(cache, corrupt):
    cache.store(key(1), b"x" * 1000, 1.0)
    cache.store(key(2), b"y" * 1000, 1.0)
    corrupt(cache, key(1))
    assert cache.load(key(1)) is None
    assert key(1).digest not in cache.entries()
    assert not cache.graph_path(key(1).digest).exists()
    assert cache.load(key(2)) == b"y" * 1000  # the others are untouched


def test_an_unreadable_manifest_means_an_empty_cache_not_a_crash(cache):
    cache.store(key(1), b"x", 1.0)
    (cache.root / "manifest.json").write_bytes(b"\x00garbage{")
    assert cache.load(key(1)) is None
    cache.store(key(1), b"x", 1.0)  # and it is rebuilt
    assert cache.load(key(1)) == b"x"


def test_verify_reports_and_evicts_bad_entries_and_orphans(cache):
    cache.store(key(1), b"x" * 100, 1.0)
    cache.store(key(2), b"y" * 100, 1.0)
    _garble(cache, key(2))
    cache.graph_path("f" * 32).write_bytes(b"orphan")
    report = cache.verify()
    assert report[key(1).digest] is None
    assert report[key(2).digest] == "checksum mismatch"
    assert report["f" * 32] == "not in the manifest"
    assert set(cache.entries()) == {key(1).digest}


def test_prune_evicts_least_recently_used_first(cache):
    for n in range(4):
        cache.store(key(n), bytes(1000), 1.0)
        time.sleep(1.1)  # timestamps have one-second resolution
    cache.load(key(0))  # 0 becomes the most recently used
    removed = cache.prune(max_bytes=2500)
    assert removed == [key(1).digest, key(2).digest]
    assert set(cache.entries()) == {key(0).digest, key(3).digest}


def test_the_size_cap_applies_on_store(tmp_path):
    cache = GraphCache(tmp_path / "c", max_bytes=2500)
    for n in range(4):
        cache.store(key(n), bytes(1000), 1.0)
    assert len(cache.entries()) == 2 and key(3).digest in cache.entries()


def test_export_then_import_into_another_cache(cache, tmp_path):
    cache.store(key(1), b"one" * 50, 3.0)
    cache.store(key(2), b"two" * 50, 4.0)
    (cache.inductor_dir / "kernel.so").write_bytes(b"built")
    archive = tmp_path / "graphs.tar.gz"
    assert cache.export(archive) == 2
    other = GraphCache(tmp_path / "elsewhere")
    assert other.import_(archive) == 2
    assert other.load(key(1)) == b"one" * 50 and other.load(key(2)) == b"two" * 50
    assert (other.inductor_dir / "kernel.so").read_bytes() == b"built"
    assert other.entries()[key(1).digest]["compile_seconds"] == 3.0


def fake_vllm_config(layers: int = 2, path: str = "/a", dtype: str = "torch.float32",
                     quantization: str | None = None, cache_dtype: str = "auto"):
    hf = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers,
          "hidden_size": 128, "_name_or_path": path, "transformers_version": "5.16.1"}
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: dict(hf)),
                                     dtype=dtype, model_impl="auto", architectures=hf["architectures"],
                                     quantization=quantization),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=32),
        parallel_config=SimpleNamespace(rank=0, tensor_parallel_size=1))


def test_the_key_covers_what_shapes_a_graph_and_nothing_else():
    options = {"backend": "inductor", "threads": 2, "isa": "AVX512"}
    base = graph_key(fake_vllm_config(), Bucket(64, 4, 16), 128, options).digest
    assert graph_key(fake_vllm_config(path="/elsewhere"), Bucket(64, 4, 16), 128, options).digest == base
    for other in (graph_key(fake_vllm_config(layers=3), Bucket(64, 4, 16), 128, options),
                  graph_key(fake_vllm_config(dtype="torch.bfloat16"), Bucket(64, 4, 16), 128, options),
                  graph_key(fake_vllm_config(quantization="fp8_per_tensor"), Bucket(64, 4, 16), 128,
                            options),
                  graph_key(fake_vllm_config(cache_dtype="fp8"), Bucket(64, 4, 16), 128, options),
                  graph_key(fake_vllm_config(), Bucket(64, 4, 4), 128, options),
                  graph_key(fake_vllm_config(), Bucket(64, 4, 16), 256, options),
                  graph_key(fake_vllm_config(), Bucket(64, 4, 16), 128, {**options, "threads": 1})):
        assert other.digest != base


def test_a_graph_of_any_width_has_no_kv_block_count_in_its_key():
    options = {"backend": "inductor", "threads": 2, "isa": "AVX512"}
    shared = graph_key(fake_vllm_config(), Bucket(64, 4, 16).any_width(), None, options)
    assert shared.fields["bucket"] == [64, 4, 0, 0] and shared.fields["kv_cache"][0] is None
    assert shared.label.endswith("t64-r4-b*")
    assert shared.digest == graph_key(fake_vllm_config(), Bucket(64, 4, 32).any_width(), None,
                                      options).digest


def test_has_sees_entries_built_by_these_versions_only(cache):
    cache.store(key(1), b"x", compile_seconds=1.0)
    assert cache.has(key(1)) and not cache.has(key(2))
    path = cache.root / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["entries"][key(1).digest]["versions"]["torch"] = "1.0.0"
    path.write_text(json.dumps(manifest))
    assert not cache.has(key(1))


def test_a_killed_writers_temp_file_goes_when_the_cache_is_next_opened(cache):
    import os

    dead = next(p for p in range(2**22, 1, -1) if not os.path.exists(f"/proc/{p}"))
    orphan = cache.root / "graphs" / f".abc.bin.{dead}.x1y2.tmp"
    live = cache.root / "graphs" / f".def.bin.{os.getpid()}.x1y2.tmp"
    orphan.write_bytes(b"half")
    live.write_bytes(b"half")
    GraphCache(cache.root)
    assert not orphan.exists() and live.exists()
