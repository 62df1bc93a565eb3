"""The platform's parallel checks and the emulated device's share of a host per rank."""

import os
from types import SimpleNamespace

import pytest

from neuron_serve import envs
from neuron_serve.device.emulated import EmulatedDevice
from neuron_serve.platform import _check_parallel


def parallel(tp=1, pp=1, dcp=1, pcp=1, dp_local=1):
    return SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                           decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp,
                           data_parallel_size_local=dp_local)


@pytest.fixture(autouse=True)
def _restore_ranks_env():
    saved = os.environ.get("NEURON_SERVE_RANKS_ON_HOST")
    yield
    if saved is None:
        os.environ.pop("NEURON_SERVE_RANKS_ON_HOST", None)
    else:
        os.environ["NEURON_SERVE_RANKS_ON_HOST"] = saved
    envs.reset_cache()


@pytest.mark.parametrize("field,flag", [("pp", "--pipeline-parallel-size"),
                                        ("dcp", "--decode-context-parallel-size"),
                                        ("pcp", "--prefill-context-parallel-size")])
def test_pipeline_and_context_parallel_are_refused_by_flag(field, flag):
    with pytest.raises(NotImplementedError, match=f"{flag} 2: .*--tensor-parallel-size"):
        _check_parallel(parallel(**{field: 2}))


def test_tensor_times_local_data_parallel_ranks_reach_the_workers():
    _check_parallel(parallel(tp=4, dp_local=2))
    assert envs.NEURON_SERVE_RANKS_ON_HOST == 8


def test_ranks_divide_the_emulated_capacity():
    with envs.override(NEURON_SERVE_EMULATED_MEMORY_GB="8"):
        device = EmulatedDevice()
        assert device.rank_memory_bytes(1) == 8 << 30
        assert device.rank_memory_bytes(4) == 2 << 30


def test_ray_actors_start_with_the_drivers_neuron_serve_settings(monkeypatch):
    """Ray actors inherit their raylet's environment: the settings that select and shape
    the platform travel in the runtime env; the driver host's rank count does not."""
    from neuron_serve.ray_cluster import carry_settings

    monkeypatch.setenv("NEURON_SERVE_DEVICE", "neuron")
    monkeypatch.setenv("NEURON_SERVE_EMULATED_MEMORY_GB", "8")
    monkeypatch.setenv("NEURON_SERVE_RANKS_ON_HOST", "2")
    config = SimpleNamespace(ray_runtime_env={"pip": ["x"], "env_vars": {"A": "1"}})
    carry_settings(config)
    assert config.ray_runtime_env["pip"] == ["x"]
    env = config.ray_runtime_env["env_vars"]
    assert env["A"] == "1" and env["NEURON_SERVE_DEVICE"] == "neuron"
    assert env["NEURON_SERVE_EMULATED_MEMORY_GB"] == "8" and "NEURON_SERVE_RANKS_ON_HOST" not in env
    empty = SimpleNamespace(ray_runtime_env=None)
    carry_settings(empty)
    assert empty.ray_runtime_env["env_vars"]["NEURON_SERVE_DEVICE"] == "neuron"
