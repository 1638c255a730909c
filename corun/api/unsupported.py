"""The protocol fields CoRun does not implement, in one table, and the models that refuse them.

Each entry maps a field of the OpenAI or vLLM protocol to the values that mean "off" (clients
send them by default: ``frequency_penalty: 0``, ``tool_choice: "none"``). Such a value, or a null,
is accepted; any other value is a 400 ``"<field>: not supported"``, never a silent no-op that would
hand the client a response it did not ask for. Implementing a field in the engine is deleting its
line here and declaring the real field in ``corun.api.protocol``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationInfo, create_model, field_validator

# Off values per field; () = only absent or null is accepted.
SAMPLING: dict[str, tuple] = {
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "early_stopping": (False,),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "truncate_prompt_tokens": (),
    "spaces_between_special_tokens": (True,),
    "logits_processors": ([],),
    "priority": (0,),
    "guided_grammar": (),
    # The one backend there is (outlines-core); naming it is accepted.
    "guided_decoding_backend": ("outlines",),
    "guided_whitespace_pattern": (),
    "structured_outputs": (),
    "cache_salt": (),
    "request_id": (),
    "vllm_xargs": (),
    "kv_transfer_params": (),
    "stream_interval": (1,),
    # Each changes the tokens, the logprobs or the response when set (vLLM).
    "logprob_token_ids": (),
    "watermarking": (False,),
    "repetition_detection": (),
    # -1 is vLLM's "unlimited", the same as unset.
    "thinking_token_budget": (-1,),
    "ec_transfer_params": (),
}
COMPLETIONS: dict[str, tuple] = {**SAMPLING, "suffix": ("",), "prompt_embeds": ()}
CHAT: dict[str, tuple] = {
    **SAMPLING,
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "reasoning_effort": (),
    "echo": (False,),
    "chat_template": (),
    "documents": (),
    "mm_processor_kwargs": (),
    "media_io_kwargs": (),
    # OpenAI's; "medium" is its default.
    "verbosity": ("medium",),
}
# /tokenize of a conversation: what would change the rendering, as in chat completions.
TOKENIZE: dict[str, tuple] = {
    "chat_template": (),
    "tools": ([],),
    "mm_processor_kwargs": (),
    "media_io_kwargs": (),
}
# Why a field is refused, where the bare "not supported" would leave the client guessing.
_STRUCTURED = "use response_format, guided_json, guided_regex or guided_choice"
REASONS: dict[str, str] = {
    "guided_grammar": f"grammar-guided decoding is not implemented ({_STRUCTURED})",
    "guided_decoding_backend": "structured output has one backend, outlines (outlines-core)",
    "guided_whitespace_pattern": "JSON whitespace is fixed (at most one space between tokens)",
    "structured_outputs": f"vLLM's structured_outputs object is not implemented ({_STRUCTURED})",
    "tools": "tool calling is not implemented",
    "tool_choice": "tool calling is not implemented",
    "functions": "tool calling is not implemented",
    "function_call": "tool calling is not implemented",
    "use_beam_search": "beam search is not implemented (sample with n or best_of)",
    "cache_salt": "the prefix cache is shared by every request (a hit gives a miss's bits)",
    "request_id": "the server names each request itself (the response's id)",
    "logprob_token_ids": "logprobs of chosen token ids are not implemented (use logprobs / "
                         "top_logprobs for the top-N)",
    "watermarking": "watermarked sampling is not implemented",
    "repetition_detection": "repetition detection is not implemented",
    "thinking_token_budget": "there is no reasoning parser to count thinking tokens with",
    "chat_template": "the model's chat template renders every conversation",
}
# Fields of one chat message (vLLM hands a developer message's tools to the template).
MESSAGE: dict[str, tuple] = {"tool_calls": ([],), "function_call": (), "audio": (), "tools": ()}
# Content part types a message may hold: text, and the Responses API's names for it, which vLLM
# parses as text too (MM_PARSER_MAP).
SUPPORTED_CONTENT_PARTS = ("text", "input_text", "output_text")


def _same(value: Any, off: Any) -> bool:
    """Equality that keeps bools apart from ints (``True == 1`` in Python)."""
    if isinstance(value, bool) or isinstance(off, bool):
        return type(value) is type(off) and value == off
    if isinstance(value, (int, float)) and isinstance(off, (int, float)):
        return value == off
    return type(value) is type(off) and value == off


def not_supported_message(off_values: tuple, field: str | None = None) -> str:
    reason = f": {REASONS[field]}" if field in REASONS else ""
    if not off_values:
        return f"not supported{reason}"
    accepted = " or ".join(repr(v) if isinstance(v, str) else _json(v) for v in off_values)
    return f"not supported{reason} (only {accepted}, its neutral value, is accepted)"


def _json(value: Any) -> str:
    import json

    return json.dumps(value)


def refusing(table: dict[str, tuple], base: type[BaseModel], name: str) -> type[BaseModel]:
    """A subclass of ``base`` with one optional field per entry of ``table``, each refusing any
    value but its off values: the error's location is the field, so the 400 names it."""

    def check(cls, value: Any, info: ValidationInfo) -> Any:
        off_values = table[info.field_name]
        if not any(_same(value, off) for off in off_values):
            raise ValueError(not_supported_message(off_values, info.field_name))
        return value

    validator = field_validator(*table)(classmethod(check))
    fields = {field: (Any, None) for field in table}
    return create_model(name, __base__=base, __validators__={"_refuse": validator}, **fields)
