"""Bucket grid planning, bucket choice and the validation of bucket settings."""

import itertools
import json
import random
from collections import Counter

import pytest

from neuron_serve.bucket_planner import (
    best_buckets,
    demand,
    evaluate,
    padded_cost,
    read_trace,
    suggest,
)
from neuron_serve.buckets import Bucket, build_grid, select
from neuron_serve.config import NeuronConfig


def make(**kw) -> NeuronConfig:
    base = dict(block_size=32, max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=256,
                compile_mode="ahead")
    return NeuronConfig(**{**base, **kw})


def test_default_grid_is_small_and_covers_the_engine_limits():
    cfg = make()
    assert cfg.token_buckets == (96, 160, 256)  # 64- and 128-token chunks beside 16 decodes
    assert cfg.request_buckets == (1, 2, 4, 8, 16)
    assert cfg.block_buckets == (8, 32)
    assert len(cfg.grid) == 17  # 5 decode + 3 mixed buckets per block bucket, 1 untiled
    assert cfg.grid[-1] == Bucket(256, 16, 32)  # the untiled one, last: it holds any step
    assert max(cfg.grid[:-1], key=lambda b: b.cost) == Bucket(256, 16, 32, query_tile=32)


@pytest.mark.parametrize("step,expected", [
    ((1, 1, 3), Bucket(1, 1, 8)),        # single decode, short context
    ((3, 3, 9), Bucket(4, 4, 32)),       # three decodes, one long context
    ((16, 16, 8), Bucket(16, 16, 8)),    # full decode batch
    ((17, 2, 1), Bucket(96, 16, 8, 32)),  # a prefill chunk with a decode
    ((256, 16, 32), Bucket(256, 16, 32, 32)),
])
def test_select_picks_the_cheapest_bucket_that_holds_the_step(step, expected):
    assert select(list(make().grid), *step) == expected


@pytest.mark.parametrize("num_scheduled,expected", [
    ([40, 1, 1], Bucket(96, 16, 8, 32)),  # one whole tile, the leftover 8 in another
    ([20, 20, 20, 20], Bucket(160, 16, 8, 32)),  # 4 leftovers of 20: 3 tiles at 96 tokens, 5 at 160
    ([17] * 15, Bucket(256, 16, 8)),  # 15 leftovers of 17: 8 tiled, 119 tokens left > 16 slots
])
def test_a_step_its_tiles_cannot_pack_moves_to_a_larger_bucket(num_scheduled, expected):
    import numpy as np

    from neuron_serve.model_runner import query_tiles
    num_scheduled = np.array(num_scheduled)
    step = (int(num_scheduled.sum()), len(num_scheduled), 8)
    grid = list(make(block_buckets=(8,), max_model_len=256).grid)
    assert select(grid, *step, lambda b: query_tiles.fits(num_scheduled, b)) == expected


def test_select_explains_a_step_no_bucket_holds():
    grid = build_grid([64], [1, 4], [8], max_num_seqs=4)
    with pytest.raises(ValueError, match="no bucket holds 65 tokens"):
        select(grid, 65, 1, 1)


@pytest.mark.parametrize("kw,message", [
    (dict(token_buckets=(64, 128)),
     "largest token bucket \\(128\\) is below max_num_batched_tokens \\(256\\)"),
    (dict(request_buckets=(1, 8)), "largest request bucket \\(8\\) is below max_num_seqs \\(16\\)"),
    (dict(block_buckets=(8, 16)), "cannot hold max_model_len \\(1024\\): add a block bucket ≥ 32"),
    (dict(token_buckets=(256, 64)), "sorted and without duplicates"),
    (dict(request_buckets=(0, 16)), "positive integers"),
    (dict(compile_mode="later"), "compile_mode='later' is not valid; use one of"),
    (dict(compile_mode="background", cache_dir=None), "background.*cache.*is off: set neuron.cache_dir"),
    (dict(cache_max_gb=0), "cache_max_gb must be positive"),
    (dict(require_precompiled=True, compile_mode="background", cache_dir="/tmp/g"),
     "require_precompiled .* needs the cache .* and compile_mode 'ahead', not 'background'"),
    (dict(require_precompiled=True, cache_dir=None), "require_precompiled .* needs the cache"),
])
def test_bad_bucket_settings_name_the_limit(kw, message):
    with pytest.raises(ValueError, match=message):
        make(**kw)


def vllm_config(neuron: dict, enforce_eager: bool = False):
    from types import SimpleNamespace as NS

    return NS(additional_config={"neuron": neuron},
              model_config=NS(enforce_eager=enforce_eager, max_model_len=1024),
              scheduler_config=NS(max_num_seqs=16, max_num_batched_tokens=256),
              cache_config=NS(block_size=32))


@pytest.mark.parametrize("neuron,env,eager,expected", [
    ({}, "", False, "background"),  # the emulated device's default
    ({"cache_dir": "off"}, "", False, "ahead"),  # background hands graphs over in the cache
    ({"require_precompiled": True}, "", False, "ahead"),
    ({}, "eager", False, "eager"),
    ({"compile_mode": "ahead"}, "eager", False, "ahead"),  # the config key wins
    ({"compile_mode": "ahead"}, "", True, "eager"),  # --enforce-eager wins
])
def test_compile_mode_defaults_to_the_devices(neuron, env, eager, expected):
    from neuron_serve import device, envs

    assert device.current().default_compile_mode == "background"
    with envs.override(NEURON_SERVE_COMPILE_MODE=env, NEURON_SERVE_CACHE_DIR="/tmp/g"):
        assert NeuronConfig.from_vllm_config(vllm_config(neuron, eager)).compile_mode == expected


def test_require_precompiled_must_be_a_bool():
    with pytest.raises(ValueError, match="require_precompiled must be true or false, got 'yes'"):
        NeuronConfig.from_vllm_config(vllm_config({"require_precompiled": "yes"}))


def test_attention_scratch_cap_names_the_bucket():
    cfg = make(max_model_len=32768, max_num_batched_tokens=2048, max_attention_scratch_gb=1.0)
    with pytest.raises(ValueError, match="bucket t2048-r16-b1024 needs .* GiB of attention scratch"):
        cfg.check_attention_scratch((8, 128, 2))


def test_bucket_flags_of_our_server_land_in_the_neuron_section():
    from neuron_serve.cli import build_parser
    from neuron_serve.cli.engine import merge_neuron_flags

    args = build_parser().parse_args([
        "serve", "--token-buckets", "64,256", "--compile-mode", "background",
        "--graph-cache-dir", "/tmp/g", "--require-precompiled", "--additional-config",
        '{"neuron": {"block_buckets": [8, 32], "token_buckets": [16]}, "other": 1}'])
    merge_neuron_flags(args)
    assert args.additional_config == {"other": 1, "neuron": {
        "block_buckets": [8, 32], "token_buckets": [64, 256], "compile_mode": "background",
        "cache_dir": "/tmp/g", "require_precompiled": True}}


def test_a_bad_bucket_flag_is_refused_by_the_parser(capsys):
    from neuron_serve.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--token-buckets", "64,lots"])
    assert "expected comma-separated integers, got '64,lots'" in capsys.readouterr().err


# ---- buckets suggest -------------------------------------------------------------------

def brute_force(counts: Counter, k: int, cap: int) -> int:
    """Least padding over every set of at most k buckets ending at cap."""
    return min(padded_cost([*edges, cap], counts)
               for n in range(k) for edges in itertools.combinations(range(1, cap), n))


@pytest.mark.parametrize("seed", range(40))
def test_best_buckets_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    cap = rng.choice([12, 20, 32])
    counts = Counter({rng.randint(1, cap): rng.randint(1, 9) for _ in range(rng.randint(1, 8))})
    k = rng.randint(1, 4)
    edges, cost = best_buckets(counts, k, cap)
    assert cost == brute_force(counts, k, cap)
    assert edges[-1] == cap and len(edges) <= k and edges == sorted(edges)


def test_token_buckets_leave_room_for_the_other_requests_decodes():
    assert make(max_num_seqs=1).token_buckets == (64, 128, 256)  # no other request
    # 64 + 32 others fit 96 and 128 + 32 fit 160; room for 33 decodes would need 128 and 192.
    assert make(max_num_seqs=33).token_buckets == (96, 160, 256)
    assert make(max_num_seqs=64).token_buckets == (128, 192, 256)


def write_trace(path, rows) -> str:
    path.write_text("\n".join(json.dumps({"prompt_tokens": p, "output_tokens": o}) for p, o in rows))
    return str(path)


def test_suggest_finds_the_known_optimum_of_a_two_length_trace(tmp_path):
    """Prompts of exactly 96 and 256 tokens: with room for two token buckets, [96, 256]
    is the only choice without prefill padding, and nothing in the budget pads less."""
    rows = [(96, 32)] * 30 + [(256, 32)] * 10
    d = demand(rows, max_num_batched_tokens=256, block_size=32, max_model_len=512)
    plan = suggest(d, request_buckets=[1, 4], max_graphs=9, max_num_batched_tokens=256,
                   max_blocks=16, block_size=32)
    assert plan.token_buckets == [96, 256]
    assert plan.num_graphs <= 9
    default = evaluate(d, [64, 256], [1, 4], [8, 16], block_size=32)
    assert plan.padded_tokens < default.padded_tokens
    # Exhaustive check of the whole search: no 9-graph set (8 + the untiled one) pads less.
    best = min(evaluate(d, [*t, 256], [1, 4], [*b, 16], 32).padded_tokens
               for nt in range(2) for t in itertools.combinations(range(1, 256), nt)
               for nb in range(3) for b in itertools.combinations(range(1, 16), nb)
               if (2 + nt + 1) * (nb + 1) + 1 <= 9)
    assert plan.padded_tokens == best


def test_suggest_command_prints_default_and_proposal_waste(tmp_path, capsys):
    from neuron_serve.cli import buckets as command
    from neuron_serve.cli import build_parser

    trace = write_trace(tmp_path / "trace.jsonl", [(96, 32)] * 30 + [(256, 32)] * 10)
    argv = ["buckets", "suggest", "--trace", str(trace), "--max-graphs", "11", "--max-num-seqs",
            "4", "--max-num-batched-tokens", "256", "--max-model-len", "512"]
    assert command.run(build_parser(argv).parse_args(argv)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("default ") and "waste" in lines[0]
    assert lines[1].startswith("proposal ") and "token [96, 256]" in lines[1]
    config = json.loads(lines[2].split("--additional-config ")[1].strip("'"))
    assert config["neuron"]["token_buckets"] == [96, 256]


def test_a_bad_trace_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_tokens": 5, "output_tokens": 1}\n{"prompt": 5}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: expected"):
        read_trace(path)


def test_trn2_servers_require_precompiled_graphs_their_job_compiles():
    from pathlib import Path

    from neuron_serve.cli import build_parser
    from neuron_serve.cli.engine import merge_neuron_flags

    config = Path(__file__).resolve().parents[2] / "deploy" / "overlays" / "trn2" / "engine.yaml"
    args = build_parser().parse_args(["serve", "--config", str(config)])
    merge_neuron_flags(args)
    assert args.additional_config["neuron"]["require_precompiled"] is True
