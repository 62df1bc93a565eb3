"""vLLM's per-token logprobs (token id → Logprob, sampled token included) in OpenAI's two
shapes: the legacy completions table and chat's list of token entries."""

from __future__ import annotations

from collections.abc import Sequence

from neuron_serve.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


def _text(token_id: int, lp, tokenizer) -> str:
    return lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([token_id])


def completion_logprobs(token_ids: Sequence[int], logprobs: list[dict], tokenizer,
                        offset: int = 0) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for token_id, step in zip(token_ids, logprobs):
        text = _text(token_id, step[token_id], tokenizer)
        out.tokens.append(text)
        out.token_logprobs.append(step[token_id].logprob)
        out.top_logprobs.append({_text(t, lp, tokenizer): lp.logprob for t, lp in step.items()})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(token_ids: Sequence[int], logprobs: list[dict], tokenizer,
                  top: int) -> ChatLogprobs:
    def entry(token_id: int, lp) -> TopLogprob:
        text = _text(token_id, lp, tokenizer)
        return TopLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()))

    content = []
    for token_id, step in zip(token_ids, logprobs):
        ranked = sorted(step.items(), key=lambda kv: -kv[1].logprob)[:top]
        chosen = entry(token_id, step[token_id])
        content.append(ChatTokenLogprob(**chosen.model_dump(),
                                        top_logprobs=[entry(t, lp) for t, lp in ranked]))
    return ChatLogprobs(content=content)
