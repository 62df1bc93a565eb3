"""Prompt logprobs (vLLM's `prompt_logprobs`, OpenAI's `echo` with `logprobs`) from the
step that prefills the prompt: no second forward, no extra bucket.

Every graph returns the final hidden states of all its token rows besides the last-token
logits. For a request that asks, the LM head then runs on the rows of its prompt chunk,
outside the graph: a rarely used feature costs one small matmul in the steps that need
it, and nothing in the others. Chunked prefills fill the request's tensors chunk by
chunk; they are handed to vLLM with the last chunk, as vLLM's GPU runner does.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.gpu_input_batch import CachedRequestState


class PromptLogprobs:
    def __init__(self, model: torch.nn.Module, sampler: Sampler, logprobs_mode: str,
                 vocab_size: int):
        self.model, self.sampler, self.logprobs_mode = model, sampler, logprobs_mode
        self.vocab_size = vocab_size
        self.wanted: dict[str, int] = {}  # request id → top-k asked for, until its prompt is done
        self.partial: dict[str, LogprobsTensors] = {}

    def add(self, state: CachedRequestState) -> None:
        params = state.sampling_params
        if params is not None and params.prompt_logprobs is not None:
            k = params.prompt_logprobs
            self.wanted[state.req_id] = self.vocab_size if k == -1 else k

    def remove(self, req_id: str) -> None:
        self.wanted.pop(req_id, None)
        self.partial.pop(req_id, None)

    def compute(self, hidden: torch.Tensor, requests: dict[str, CachedRequestState],
                row_of: dict[str, int], num_scheduled: np.ndarray) -> dict[str, LogprobsTensors]:
        """The prompt logprobs of requests whose prompt ends in this step, given the step's
        hidden states [tokens, hidden] (requests' tokens back to back in batch-row order)."""
        if not self.wanted:
            return {}
        starts = np.cumsum(num_scheduled) - num_scheduled
        done: dict[str, LogprobsTensors] = {}
        for req_id, k in list(self.wanted.items()):
            row = row_of.get(req_id)
            if row is None or row >= len(num_scheduled):  # not scheduled (preempted): later
                continue
            state = requests[req_id]
            prompt = state.prompt_token_ids
            first = state.num_computed_tokens  # the chunk's first position
            # Position i predicts prompt token i + 1: the last prompt position predicts nothing.
            count = min(int(num_scheduled[row]), len(prompt) - 1 - first)
            tensors = self.partial.get(req_id)
            if tensors is None:
                tensors = self.partial[req_id] = LogprobsTensors.empty_cpu(len(prompt) - 1, k + 1)
            if count > 0:
                rows = hidden[int(starts[row]): int(starts[row]) + count]
                self._fill(tensors, first, rows, prompt[first + 1: first + 1 + count], k)
            if first + int(num_scheduled[row]) >= len(prompt):
                done[req_id] = tensors
                self.remove(req_id)
        return done

    @torch.no_grad()
    def _fill(self, tensors: LogprobsTensors, first: int, rows: torch.Tensor,
              targets: list[int], k: int) -> None:
        logits = self.model.compute_logits(rows)
        # Prompt tokens skip the sampling processors: processed_* equals raw_* here.
        scores = (logits.float() if self.logprobs_mode in ("raw_logits", "processed_logits")
                  else self.sampler.compute_logprobs(logits))
        ids, logprobs, ranks, *_ = self.sampler.gather_logprobs(
            scores, k, torch.tensor(targets, dtype=torch.long, device=rows.device))
        span = slice(first, first + len(targets))
        tensors.logprob_token_ids[span].copy_(ids)
        tensors.logprobs[span].copy_(logprobs)
        tensors.selected_token_ranks[span].copy_(ranks)
