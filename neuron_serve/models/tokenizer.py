"""Train a byte-level BPE tokenizer offline and save it as a Hugging Face tokenizer."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
USER, ASSISTANT, SYSTEM, END = "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, USER, ASSISTANT, SYSTEM, END]
# Reasoning delimiters for the test checkpoints (vLLM's `deepseek_r1` and `qwen3` parsers
# look them up as single tokens).
THINK_TOKENS = ["<think>", "</think>"]

# Each turn is "<|role|>\n{content}<|end|>\n"; generation is prompted with "<|assistant|>\n"
# and stops at <|end|> (declared as an end-of-sequence token in generation_config.json).
# Tools, tool calls and tool results render in the Hermes format (vLLM's `hermes` tool
# parser reads the calls back): the tools' JSON schemas in a system turn, a call as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>, a result in <tool_response>.
CHAT_TEMPLATE = """{{ bos_token }}
{%- if tools %}{{ '<|system|>\nTo call a tool, answer '
    '<tool_call>{"name": NAME, "arguments": ARGUMENTS}</tool_call>. Tools:\n<tools>\n' }}
{%- for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}{{ '</tools><|end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'tool' %}
{{- '<|tool|>\n<tool_response>' + message['content'] + '</tool_response><|end|>\n' }}
{%- else %}{{ '<|' + message['role'] + '|>\n' + (message['content'] or '') }}
{%- for call in message.get('tool_calls') or [] %}
{%- set arguments = call['function']['arguments'] %}
{{- '<tool_call>{"name": "' + call['function']['name'] + '", "arguments": ' }}
{{- arguments if arguments is string else arguments | tojson }}{{ '}</tool_call>' }}
{%- endfor %}{{ '<|end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"""


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE over `texts`; deterministic for the same texts and size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Like Llama's tokenizer: encoding with special tokens prepends BOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def save_hf_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json + tokenizer_config.json (with the chat template) to `out_dir`."""
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[USER, ASSISTANT, SYSTEM, END],
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
        add_bos_token=True,
    )
    hf_tok.save_pretrained(out_dir)


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
