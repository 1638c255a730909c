"""What every request model shares: the engine's bounds on its numbers, valid Unicode for its
strings, and the strict base model whose explicit nulls mean "unset" (``corun.api.protocol``
states the rules)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator

# OpenAI caps top_logprobs at 20; vLLM's default max_logprobs is 20 too.
MAX_LOGPROBS = 20
# Beyond this, n is a denial-of-service knob more than a sampling parameter.
MAX_N = 128
# The engine's Philox keys are 64-bit unsigned; a drawn seed can be >= 2**63 and must replay.
# Negative seeds down to int64's are taken as vLLM takes them (corun.sampling_params.MIN_SEED).
MAX_SEED = 2**64 - 1
MIN_SEED = -(2**63)
# The sampler holds top_k in an int32 tensor; token counts are int32 on the device too.
MAX_INT32 = 2**31 - 1
MAX_INT64 = 2**63 - 1
# top_p is an fp32 on the device: a smaller positive value rounds to 0, outside (0, 1].
MIN_TOP_P = 2.0**-126
# Every stop string is matched and every stop id checked at every step of the request, on the
# engine thread that all requests share: bound the lists (OpenAI allows 4 stop strings).
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 1024
# OpenAI accepts up to 300 logit_bias entries; each costs a write per sampled token.
MAX_LOGIT_BIAS = 1024


def valid_unicode(text: str) -> str:
    """Reject lone surrogates: they are not Unicode scalar values, so no UTF-8 exists for them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise ValueError(
            f"invalid Unicode: lone surrogate {bad!r} at index {exc.start} (send valid UTF-8)"
        ) from None
    return text


# Every string of a request is a Text.
Text = Annotated[str, AfterValidator(valid_unicode)]


def check_json_strings(value: Any) -> Any:
    """Every string (keys included) of a free-form JSON value is valid Unicode."""
    if isinstance(value, str):
        valid_unicode(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_json_strings(key)
            check_json_strings(item)
    elif isinstance(value, list):
        for item in value:
            check_json_strings(item)
    return value


class StrictRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        # An explicit null takes the field's default, exactly as if the field were absent.
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data
