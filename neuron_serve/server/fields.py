"""No silently ignored field: the fields of OpenAI's completions and chat-completions
request schemas that vLLM's serving classes do not honour, and when a value of one still
counts as honoured (absent, its default, or a value that changes nothing). Anything else
is refused with a 400 naming the field. Fields outside OpenAI's schemas stay accepted
(clients send new ones first), as vLLM's request models accept them.

The README's table "OpenAI request fields" lists the same rules for users.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from neuron_serve.server.errors import ServerError

Rule = Callable[[Any, dict], bool]  # (value, the whole request) → the value is honoured


def _unset(value: Any, _: dict | None = None) -> bool:
    return value is None or value == [] or value == {}


def _any(value: Any, _: dict) -> bool:
    return True


def _one_of(*allowed: Any) -> Rule:
    return lambda value, _: _unset(value) or value in allowed


def _text_only(value: Any, _: dict) -> bool:
    return _unset(value) or list(value) == ["text"]


def _best_of_is_n(value: Any, request: dict) -> bool:
    return _unset(value) or value in (1, request.get("n") or 1)


def _no_obfuscation_asked(options: Any, _: dict) -> bool:
    """Stream obfuscation pads chunks against side channels; we send none, so only its
    opt-out (or silence) is honoured."""
    return _unset(options) or not isinstance(options, dict) or \
        options.get("include_obfuscation", False) is False


# field → (honoured when, what the user should change)
CHAT: dict[str, tuple[Rule, str]] = {
    "audio": (_unset, "audio output is not supported; leave out audio"),
    "modalities": (_text_only, 'only text output is supported: modalities ["text"]'),
    "functions": (_unset, "the deprecated functions are not supported; send tools"),
    "function_call": (_unset, "the deprecated function_call is not supported; send tool_choice"),
    "prediction": (_unset, "predicted outputs are not supported; leave out prediction"),
    "web_search_options": (_unset, "web search is not supported"),
    "moderation": (_unset, "moderation is not supported"),
    "store": (_one_of(False), "this server stores nothing: store must be false"),
    "service_tier": (_one_of("auto", "default"), 'only service_tier "auto" or "default"'),
    "verbosity": (_one_of("medium"), 'only verbosity "medium" (the default) is supported'),
    "prompt_cache_retention": (_one_of("in-memory", "in_memory"),
                               "prefixes are cached in memory only (automatic prefix caching)"),
    "prompt_cache_options": (_unset, "prefix caching is automatic; leave out prompt_cache_options"),
    "stream_options": (_no_obfuscation_asked,
                       "stream obfuscation is not supported: include_obfuscation must be false"),
    # Values that change nothing here: nothing is stored, prefixes are cached for every
    # request, and an end user's id is not used.
    "metadata": (_any, ""),
    "prompt_cache_key": (_any, ""),
    "safety_identifier": (_any, ""),
}
COMPLETION: dict[str, tuple[Rule, str]] = {
    "best_of": (_best_of_is_n, "best_of is not supported; leave it out or equal to n"),
}


def _sent(request: BaseModel) -> dict[str, Any]:
    extra = request.model_extra or {}
    return {**{name: getattr(request, name) for name in request.model_fields_set}, **extra}


def refuse_unhonoured(request: BaseModel, rules: dict[str, tuple[Rule, str]]) -> None:
    """Raise a 400 naming the first field whose value this server would not honour."""
    sent = _sent(request)
    for field, (honoured, advice) in rules.items():
        if field not in sent:
            continue
        value = sent[field]
        if isinstance(value, BaseModel):
            value = value.model_dump(exclude_unset=True)
        if not honoured(value, sent):
            raise ServerError(f"{field}: {advice} (got {value!r})", param=field)
