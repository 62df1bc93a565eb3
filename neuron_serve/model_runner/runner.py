"""NeuronModelRunner: vLLM's scheduler output in, one padded bucketed step out.

Per step:  update request state (vLLM's InputBatch keeps it) → pack the ragged batch
and pad it into its bucket (inputs.py) → run the bucket's compiled graph (graphs.py) →
sample with vLLM's Sampler → record the new tokens. Prompt logprobs, where asked for, come
from the same step's hidden states (prompt_logprobs.py).
"""

from __future__ import annotations

import shlex

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.model_loader import get_model
from vllm.sampling_params import SamplingType
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from vllm.v1.worker.utils import allocate_kv_cache, bind_kv_cache

from neuron_serve import device as device_mod
from neuron_serve.attention import kernels
from neuron_serve.attention import layer as attention_layer
from neuron_serve.attention.backend import cache_torch_dtype
from neuron_serve.config import NeuronConfig
from neuron_serve.graph_cache.key import graph_key
from neuron_serve.graph_cache.store import GraphCache
from neuron_serve.logs import init_logger
from neuron_serve.model_runner import background, compile_regions
from neuron_serve.model_runner.graphs import StepGraphs, log_progress
from neuron_serve.model_runner.inputs import StepPlan, plan_step
from neuron_serve.model_runner.prompt_logprobs import PromptLogprobs

logger = init_logger(__name__)


class NeuronModelRunner:
    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.device = device
        self.config = NeuronConfig.from_vllm_config(vllm_config)
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = self._make_input_batch()
        self.sampler = Sampler(logprobs_mode=self.model_config.logprobs_mode)
        self.model: torch.nn.Module | None = None
        self.graphs: StepGraphs | None = None
        self.kv_cache_config: KVCacheConfig | None = None
        self.background: background.BackgroundCompile | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.prompt_logprobs: PromptLogprobs | None = None
        self._pending: tuple[StepPlan, torch.Tensor, SchedulerOutput, dict] | None = None

    def _make_input_batch(self) -> InputBatch:
        cfg = self.config
        return InputBatch(
            max_num_reqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len,
            max_num_batched_tokens=cfg.max_num_batched_tokens, device=self.device,
            vocab_size=self.model_config.get_vocab_size(), block_sizes=[cfg.block_size],
            max_num_blocks_per_req=[cfg.max_blocks_per_seq],
            logitsprocs=build_logitsprocs(self.vllm_config, self.device, False, False))

    # ---- lifecycle -------------------------------------------------------------------

    def load_model(self) -> None:
        """vLLM's model, its attention layers on the device's kernels (one metadata object
        per step for all layers), rewritten for the device, layers marked as compile regions
        where the device compiles so."""
        dev = device_mod.current()
        self.model = model = get_model(vllm_config=self.vllm_config).eval()
        self.prompt_logprobs = PromptLogprobs(model, self.sampler, self.model_config.logprobs_mode,
                                              self.model_config.get_vocab_size())
        attention_layer.adopt(model, kernels.get(dev.attention_kernel))
        dev.prepare_model(model)
        if dev.regional_compile:
            count = compile_regions.compile_layers_once(model)
            logger.info("%d decoder layers compiled once per graph", count)

    def attention_layers(self) -> dict[str, AttentionLayerBase]:
        from vllm.config import get_layers_from_vllm_config
        return get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        specs = {name: layer.get_kv_cache_spec(self.vllm_config)
                 for name, layer in self.attention_layers().items()}
        return {name: spec for name, spec in specs.items() if spec is not None}

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the KV cache and set up the bucket graphs."""
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise NotImplementedError("neuron-serve supports models with one KV-cache group "
                                      f"(got {len(kv_cache_config.kv_cache_groups)})")
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        if block_size != self.config.block_size:
            raise RuntimeError(f"KV cache block size {block_size} differs from the one the "
                               f"buckets were planned for ({self.config.block_size})")
        layout = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
        with device_mod.current().kv_cache_memory():
            views = allocate_kv_cache(kv_cache_config, self.device, layout)
        # [blocks, kv heads, block size, 2 * head] → token-major [blocks, block size, kv heads, 2 * head]
        caches = {name: t.permute(0, 2, 1, 3) for name, t in views.items()}
        fp8 = cache_torch_dtype(self.vllm_config.cache_config.cache_dtype)
        if fp8 is not None:  # vLLM's uint8 bytes, read as the format
            caches = {name: t.view(fp8) for name, t in caches.items()}
        if not all(t.is_contiguous() for t in caches.values()):
            raise RuntimeError(f"KV cache layout {layout} is not token-major; the neuron "
                               "attention backend declares LBNHC")
        bind_kv_cache(caches, self.vllm_config.compilation_config.static_forward_context,
                      self.kv_caches)
        self.kv_cache_config = kv_cache_config
        self.graphs = self._make_graphs(kv_cache_config.num_blocks)

    def _make_graphs(self, num_blocks: int) -> StepGraphs:
        dev, cfg = device_mod.current(), self.config
        cache = key_of = None
        if cfg.compile and cfg.cache_dir:
            cache = GraphCache(cfg.cache_dir, int(cfg.cache_max_gb * 1e9))
            # The compiler's own builds live in the cache too: pruned and exported with it.
            dev.use_compiler_cache(cache.inductor_dir)
            options = dev.compile_options()
            kv_blocks = None if dev.symbolic_context else num_blocks

            def key_of(graph):
                return graph_key(self.vllm_config, graph, kv_blocks, options)
        return StepGraphs(self.model, self.vllm_config, list(cfg.grid), dev, cfg.compile,
                          cache, key_of, self.kv_caches)

    def warm_up(self, progress=log_progress) -> float:
        """Give buckets their graphs per the compile mode; seconds spent."""
        mode = self.config.compile_mode
        if mode == "eager":
            return 0.0
        strict = self.config.require_precompiled
        seconds = self.graphs.warm_up(compile_missing=mode == "ahead" and not strict,
                                      progress=progress)
        missing = self.graphs.missing()
        if missing and strict:
            raise RuntimeError(
                f"neuron.require_precompiled: the graph cache {self.config.cache_dir} lacks "
                f"{len(missing)} of the {len(self.graphs.traced_on)} graphs these settings need "
                f"({', '.join(map(str, missing))}). Fill it on a host of this kind (the "
                f"{device_mod.current().backend} backend's graphs depend on it) with the "
                f"server's flags:\n    {self._precompile_command()}")
        if missing:
            self.background = background.BackgroundCompile.start(
                self.vllm_config, self.kv_cache_config, missing)
        stats = self.graphs.stats
        logger.info("%d of %d graphs ready for %d buckets in %.1f s (%d loaded from %s, %d "
                    "compiled)%s", len(self.graphs.graphs), len(self.graphs.traced_on),
                    len(self.config.grid), seconds, stats.cache_hits, self.config.cache_dir,
                    stats.cache_misses,
                    f"; compiling {len(missing)} in the background" if missing else "")
        return seconds

    def _precompile_command(self) -> str:
        """The `neuron-serve compile` command that stores every graph this runner needs."""
        cfg, model = self.config, self.model_config
        cache = self.vllm_config.cache_config
        args = ["neuron-serve", "compile", model.model, "--max-model-len", model.max_model_len,
                "--max-num-seqs", cfg.max_num_seqs,
                "--max-num-batched-tokens", cfg.max_num_batched_tokens,
                "--block-size", cfg.block_size, "--dtype", str(model.dtype).removeprefix("torch."),
                *(a for name in ("token", "request", "block") for a in (
                    f"--{name}-buckets", ",".join(map(str, getattr(cfg, f"{name}_buckets"))))),
                "--graph-cache-dir", cfg.cache_dir]
        if cache.cache_dtype != "auto":
            args += ["--kv-cache-dtype", cache.cache_dtype]
        if self.vllm_config.parallel_config.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", self.vllm_config.parallel_config.tensor_parallel_size]
        if not device_mod.current().symbolic_context:  # the KV size is part of every key
            args += ["--num-gpu-blocks-override", self.kv_cache_config.num_blocks]
        return shlex.join(map(str, args))

    # ---- per step --------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self.input_batch
        n = batch.num_reqs
        num_scheduled = np.array([scheduler_output.num_scheduled_tokens[r] for r in batch.req_ids[:n]])
        plan, arrays = plan_step(batch.token_ids_cpu, batch.num_computed_tokens_cpu[:n],
                                 batch.num_tokens_no_spec[:n],
                                 batch.block_table[0].get_numpy_array(), num_scheduled,
                                 self.config.block_size, self.config.grid)
        if self.background is not None and self.background.poll(self.graphs):
            self.background = None
        self.graphs.buffers[plan.bucket].fill(arrays)
        logits, hidden = self.graphs.run(plan.bucket, plan.num_tokens)
        prompt_logprobs = self.prompt_logprobs.compute(hidden, self.requests,
                                                       batch.req_id_to_index, num_scheduled)
        self._pending = (plan, logits[:n], scheduler_output, prompt_logprobs)
        return None  # sample_tokens follows, with the grammar bitmask if any

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        plan, logits, scheduler_output, prompt_logprobs = self._pending
        self._pending = None
        batch = self.input_batch
        if grammar_output is not None:
            from vllm.v1.structured_output.utils import apply_grammar_bitmask
            apply_grammar_bitmask(scheduler_output, grammar_output, batch, logits)
        discard = [int(i) for i in np.nonzero(plan.partial_prefill)[0]]
        # A partial prefill's sample is thrown away; its seeded generator must not move.
        saved = {i: batch.generators[i].get_state() for i in discard if i in batch.generators}
        out = self.sampler(logits=logits, sampling_metadata=batch.sampling_metadata)
        for i, state in saved.items():
            batch.generators[i].set_state(state)
        sampled = out.sampled_token_ids.tolist()
        for i in discard:
            sampled[i] = []
        self._record(sampled)
        logprobs = out.logprobs_tensors.tolists() if out.logprobs_tensors is not None else None
        return ModelRunnerOutput(req_ids=list(batch.req_ids[: plan.num_reqs]),
                                 req_id_to_index=dict(batch.req_id_to_index),
                                 sampled_token_ids=sampled, logprobs=logprobs,
                                 prompt_logprobs_dict=prompt_logprobs)

    def _record(self, sampled: list[list[int]]) -> None:
        batch = self.input_batch
        for i, tokens in enumerate(sampled):
            if not tokens:
                continue
            start = int(batch.num_tokens_no_spec[i])
            end = start + len(tokens)
            batch.token_ids_cpu[i, start:end] = tokens
            batch.is_token_ids[i, start:end] = True
            batch.num_tokens_no_spec[i] = end
            self.requests[batch.req_ids[i]].output_token_ids.extend(tokens)

    def _update_states(self, so: SchedulerOutput) -> None:
        """Mirror the scheduler's view into `requests` and the persistent InputBatch."""
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self.prompt_logprobs.remove(req_id)
            batch.remove_request(req_id)
        resumed = so.scheduled_cached_reqs.resumed_req_ids
        scheduled = so.num_scheduled_tokens.keys() - resumed
        # Preempted or idle this step: out of the batch, state kept for later.
        for req_id in batch.req_id_to_index.keys() - scheduled:
            batch.remove_request(req_id)
        to_add = [self._new_state(new) for new in so.scheduled_new_reqs]
        to_add += self._update_cached(so.scheduled_cached_reqs)
        for state in to_add:
            batch.add_request(state)
        batch.condense()
        batch.refresh_metadata()

    def _new_state(self, new) -> CachedRequestState:
        params = new.sampling_params
        generator = None
        if params is not None and params.sampling_type == SamplingType.RANDOM_SEED:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        state = CachedRequestState(
            req_id=new.req_id, prompt_token_ids=new.prompt_token_ids, mm_features=new.mm_features,
            sampling_params=params, generator=generator, block_ids=new.block_ids,
            num_computed_tokens=new.num_computed_tokens, output_token_ids=[],
            lora_request=new.lora_request)
        self.requests[new.req_id] = state
        self.prompt_logprobs.add(state)
        return state

    def _update_cached(self, cached) -> list[CachedRequestState]:
        batch, readd = self.input_batch, []
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_blocks = cached.new_block_ids[i]
            num_output = cached.num_output_tokens[i]
            if num_output < len(state.output_token_ids):
                del state.output_token_ids[num_output:]
            if req_id in cached.resumed_req_ids:
                state.block_ids = new_blocks  # recomputed from scratch in fresh blocks
            elif new_blocks is not None:
                for ids, extra in zip(state.block_ids, new_blocks):
                    ids.extend(extra)
            idx = batch.req_id_to_index.get(req_id)
            if idx is None:
                readd.append(state)
                continue
            batch.num_computed_tokens_cpu[idx] = state.num_computed_tokens
            if new_blocks is not None:
                batch.block_table.append_row(new_blocks, idx)
        return readd

    @property
    def compiles_after_warmup(self) -> int:
        return self.graphs.compiles_after_warmup if self.graphs else 0
