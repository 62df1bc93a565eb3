"""schemathesis hooks for test_openapi_fuzz (loaded through SCHEMATHESIS_HOOKS).

Generation length is not under test there: valid requests are kept short so the run
covers many cases rather than a few long generations, and they name the served model
(a random name only ever tests the 404 path)."""

import schemathesis

SERVED_MODEL = "tiny"
CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "max_output_tokens": 8, "min_tokens": 8, "n": 2,
        "top_logprobs": 2, "logprobs": 2}


@schemathesis.hook
def before_call(context, case, kwargs) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = SERVED_MODEL
    for key, cap in CAPS.items():
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap
