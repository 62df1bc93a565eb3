"""Bucket grid planning, bucket choice and the validation of bucket settings."""

import pytest

from neuron_serve.config import NeuronConfig
from neuron_serve.model_runner.buckets import Bucket, build_grid, select


def make(**kw) -> NeuronConfig:
    base = dict(block_size=32, max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=256,
                compile_mode="ahead")
    return NeuronConfig(**{**base, **kw})


def test_default_grid_is_small_and_covers_the_engine_limits():
    cfg = make()
    assert cfg.token_buckets == (64, 256)
    assert cfg.request_buckets == (1, 4, 16)
    assert cfg.block_buckets == (8, 32)
    assert len(cfg.grid) == 10
    biggest = max(cfg.grid, key=lambda b: b.cost)
    assert biggest == Bucket(256, 16, 32)


@pytest.mark.parametrize("step,expected", [
    ((1, 1, 3), Bucket(1, 1, 8)),        # single decode, short context
    ((3, 3, 9), Bucket(4, 4, 32)),       # three decodes, one long context
    ((16, 16, 8), Bucket(16, 16, 8)),    # full decode batch
    ((17, 2, 1), Bucket(64, 16, 8)),     # a prefill chunk with a decode
    ((256, 16, 32), Bucket(256, 16, 32)),
])
def test_select_picks_the_cheapest_bucket_that_holds_the_step(step, expected):
    assert select(list(make().grid), *step) == expected


def test_select_explains_a_step_no_bucket_holds():
    grid = build_grid([64], [1, 4], [8], max_num_seqs=4)
    with pytest.raises(ValueError, match="no bucket holds 65 tokens"):
        select(grid, 65, 1, 1)


@pytest.mark.parametrize("kw,message", [
    (dict(token_buckets=(64, 128)), "largest token bucket \\(128\\) is below max_num_batched_tokens \\(256\\)"),
    (dict(request_buckets=(1, 8)), "largest request bucket \\(8\\) is below max_num_seqs \\(16\\)"),
    (dict(block_buckets=(8, 16)), "cannot hold max_model_len \\(1024\\): add a block bucket ≥ 32"),
    (dict(token_buckets=(256, 64)), "sorted and without duplicates"),
    (dict(request_buckets=(0, 16)), "positive integers"),
])
def test_bad_bucket_settings_name_the_limit(kw, message):
    with pytest.raises(ValueError, match=message):
        make(**kw)


def test_attention_scratch_cap_names_the_bucket():
    cfg = make(max_model_len=32768, max_num_batched_tokens=2048, max_attention_scratch_gb=1.0)
    with pytest.raises(ValueError, match="bucket t2048-r16-b1024 needs .* GiB of attention scratch"):
        cfg.check_attention_scratch((8, 128, 2))
