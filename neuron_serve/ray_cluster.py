"""Serving on a Ray cluster (`--distributed-executor-backend ray`).

vLLM's Ray executor places one worker actor per unit of the platform's `ray_device_key`,
here Ray's NeuronCore resource `neuron_cores`: Ray detects it on Trainium, and any other
node declares it (`ray start --resources '{"neuron_cores": N}'`), so the same placement
runs on both. Two things vLLM cannot know are settled here: an actor starts with its
raylet's environment, so the settings that select and configure this platform must travel
in the runtime env the executor gives every actor; and a worker's share of its node is its
NeuronCore among the node's, not its rank among the engine's processes.
"""

from __future__ import annotations

import os

from neuron_serve.logs import init_logger

logger = init_logger(__name__)

RESOURCE = "neuron_cores"
# Describes the driver's host, not an actor's node.
HOST_ONLY = frozenset({"NEURON_SERVE_RANKS_ON_HOST"})


def carry_settings(parallel) -> None:
    """Put the driver's NEURON_SERVE_* settings (the platform's activation among them) in
    the runtime env every worker actor starts with."""
    ours = {k: v for k, v in os.environ.items()
            if k.startswith("NEURON_SERVE_") and k not in HOST_ONLY}
    runtime_env = dict(parallel.ray_runtime_env or {})
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **ours}
    parallel.ray_runtime_env = runtime_env


def node_share() -> tuple[int, int]:
    """In a worker actor: (its NeuronCore's index on its node, the node's NeuronCores)."""
    import ray

    context = ray.get_runtime_context()
    core = int(context.get_accelerator_ids()[RESOURCE][0])
    node = next(n for n in ray.nodes() if n["NodeID"] == context.get_node_id())
    cores = int(node["Resources"][RESOURCE])
    logger.info("Ray node %s (%s): this worker holds NeuronCore %d of the node's %d",
                node["NodeID"], node["NodeManagerAddress"], core, cores)
    return core, cores
