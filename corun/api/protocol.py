"""OpenAI-compatible request models (pydantic v2), as vLLM's server speaks them.

Requests are validated *strictly* (``"16"`` is not an int, ``true`` is not a number) and every
range check lives in a field constraint, so a bad request is rejected before it reaches the engine
with an HTTP 400 whose body names the field. Rules every request model follows:

- an explicit JSON ``null`` means "unset" (the field takes its default), as the openai client sends
  ``null`` for ``None``;
- every number is bounded to what the engine can represent (``top_k`` is an int32 on the device,
  ``seed`` a 64-bit Philox key, ``top_p`` an fp32 > 0), so no value can fail inside an engine step;
- every string must be valid Unicode (a lone UTF-16 surrogate such as ``"\\ud800"`` cannot be
  tokenized or even encoded as UTF-8);
- a field of the OpenAI or vLLM protocols that CoRun does not implement is refused with
  ``"<field>: not supported"`` unless it holds its neutral value (``UNSUPPORTED_FIELDS``); other
  unknown fields are ignored, as vLLM and OpenAI ignore them.

The shared base model and bounds are in ``corun.api.request_base``, ``response_format`` in
``corun.api.response_format``, and response models in ``corun.api.response_models``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from corun.api import unsupported
from corun.api.request_base import (
    MAX_INT32,
    MAX_INT64,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_SEED,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MIN_SEED,
    MIN_TOP_P,
    StrictRequest,
    Text,
    check_json_strings,
)
from corun.api.response_format import STRUCTURED_FIELDS, ResponseFormat
from corun.structured_output import StructuredOutput


class StreamOptions(StrictRequest):
    include_usage: bool = False
    # vLLM: usage on every chunk, not only on the final one.
    continuous_usage_stats: bool = False


def _prompt_kind(prompt: Any) -> str:
    """Which member of the prompt union a value is, from its first element: validating it against
    every member would collect one error per element of a long token list (seconds for 3M ids)."""
    if isinstance(prompt, str):
        return "str"
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], str):
            return "list[str]"
        if isinstance(prompt[0], list):
            return "list[list[int]]"
    return "list[int]"


TokenIds = list[Annotated[int, Field(ge=0, le=MAX_INT64)]]
Prompt = Annotated[
    (
        Annotated[Text, Tag("str")]
        | Annotated[list[Text], Tag("list[str]")]
        | Annotated[TokenIds, Tag("list[int]")]
        | Annotated[list[TokenIds], Tag("list[list[int]]")]
    ),
    Discriminator(_prompt_kind),
]


def _str_or(kind: str) -> Any:
    return lambda value: "str" if isinstance(value, str) else kind


# A stop string or a list of them, told apart up front so that an error names the bad one.
StopStrings = Annotated[
    Annotated[Text, Tag("str")] | Annotated[list[Text], Tag("list")], Discriminator(_str_or("list"))
]


class _SamplingFields(StrictRequest):
    """The sampling fields both endpoints share (OpenAI's plus vLLM's ``top_k`` etc.)."""

    model: Text | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, ge=MIN_TOP_P, le=1.0, allow_inf_nan=False)
    # 0 or -1 disable top-k, as in vLLM; k >= the vocabulary size keeps every token.
    top_k: int = Field(default=0, ge=-1, le=MAX_INT32)
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = Field(default=None, ge=MIN_SEED, le=MAX_SEED)
    stop: StopStrings | None = None
    stop_token_ids: TokenIds | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    # vLLM: special tokens are left out of the output text unless this is false.
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    # vLLM: logprobs name tokens "token_id:<id>" (token texts can collide or be partial UTF-8).
    return_tokens_as_token_ids: bool = False
    user: Text | None = None
    # Per-request logits processing (corun.logits_processing), vLLM's ranges.
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0, allow_inf_nan=False)
    # OpenAI: token id (a JSON object key, so a string) -> bias in [-100, 100].
    logit_bias: dict[Text, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] \
        | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    min_tokens: int = Field(default=0, ge=0, le=MAX_INT32)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    # vLLM: the top-N of every prompt position (sample 0), in the choice's prompt_logprobs.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Structured output (corun.grammar): at most one of these; the one given, built once by
    # the validator below.
    _structured: StructuredOutput | None = PrivateAttr(default=None)
    response_format: ResponseFormat | None = None
    # vLLM: a JSON schema (an object, or its JSON text), a regex matched in full, or a list of
    # strings the output is exactly one of.
    guided_json: Annotated[dict[str, Any], AfterValidator(check_json_strings)] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Annotated[Text, Field(min_length=1)]] | None = Field(default=None,
                                                                             min_length=1)

    @field_validator("guided_json")
    @classmethod
    def _check_guided_json(cls, schema: dict | str | None) -> dict | str | None:
        if schema is not None:
            StructuredOutput.from_schema(schema, field="guided_json")
        return schema

    @model_validator(mode="after")
    def _one_structured_output(self) -> _SamplingFields:
        given = {name: structured for name in STRUCTURED_FIELDS
                 if (structured := self._structured_of(name)) is not None}
        if len(given) > 1:
            names = list(given)
            raise ValueError(f"{names[1]}: only one of {', '.join(STRUCTURED_FIELDS)} may be "
                             f"set (got {' and '.join(names)})")
        self._structured = next(iter(given.values()), None)
        return self

    def _structured_of(self, name: str) -> StructuredOutput | None:
        if name == "response_format":
            kind = getattr(self.response_format, "type", "text")
            if kind == "json_object":
                return StructuredOutput("json_object", field="response_format")
            return self.response_format.json_schema.structured if kind == "json_schema" else None
        value = getattr(self, name)
        if value is None:
            return None
        if name == "guided_json":
            return StructuredOutput.from_schema(value, field=name)
        if name == "guided_regex":
            return StructuredOutput("regex", value, field=name)
        return StructuredOutput.from_choices(value, field=name)

    @property
    def structured(self) -> StructuredOutput | None:
        """The request's structured output, if any (``SamplingParams.structured``)."""
        return self._structured

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, options: StreamOptions | None,
                              info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("only allowed with stream=true (vLLM's rule)")
        return options

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isascii() or not key.isdigit() or int(key) > MAX_INT64:
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
        return bias

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if best_of is not None and best_of < n:
            raise ValueError(f"best_of must be >= n ({n}), got {best_of}")
        if best_of is not None and best_of > n and info.data.get("stream"):
            raise ValueError("best_of > n is not supported with stream (the n best are known "
                             "only once all best_of samples finished)")
        return best_of

    @property
    def logit_bias_ids(self) -> dict[int, float] | None:
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return stop

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM: usage on every chunk when both include_usage and continuous_usage_stats."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(
    unsupported.refusing(unsupported.COMPLETIONS, _SamplingFields, "_CompletionFields")
):
    """``POST /v1/completions``: text or token-id prompts, one or a batch."""

    prompt: Prompt
    # 0 with echo and logprobs scores the prompt (lm-evaluation-harness's loglikelihood).
    max_tokens: int = Field(default=16, ge=0, le=MAX_INT32)
    # OpenAI: the number of most likely tokens to return per position (the chosen one is always in).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: str | list) -> str | list:
        if isinstance(prompt, list) and len(prompt) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt, list) and any(isinstance(p, list) and not p for p in prompt):
            raise ValueError("prompt token lists must not be empty")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts as a batch: one string or one id list per entry."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


class TextContent(StrictRequest):
    type: Literal["text", "input_text", "output_text"]
    text: Text


class OtherContent(StrictRequest):
    """A content part of another type (image_url, input_audio, file, ...): refused by name."""

    type: Text

    @field_validator("type")
    @classmethod
    def _refuse(cls, kind: str) -> str:
        allowed = ", ".join(repr(t) for t in unsupported.SUPPORTED_CONTENT_PARTS)
        raise ValueError(f"content parts of type {kind!r}: not supported (only {allowed})")


def _part_kind(part: Any) -> str:
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return "text-part" if kind in unsupported.SUPPORTED_CONTENT_PARTS else "other-part"


ContentPart = Annotated[
    Annotated[TextContent, Tag("text-part")] | Annotated[OtherContent, Tag("other-part")],
    Discriminator(_part_kind),
]


# A string or a list of parts, told apart up front so that an error names the part that failed.
Content = Annotated[
    Annotated[Text, Tag("str")] | Annotated[list[ContentPart], Tag("list")],
    Discriminator(_str_or("list")),
]


class ChatMessage(unsupported.refusing(unsupported.MESSAGE, StrictRequest, "_MessageFields")):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: Text | None = None
    # vLLM hands these to the chat template: an assistant message's earlier reasoning (sent as
    # either name, rendered under both), a tool message's call id and any message's task marker
    # (DeepSeek V4's template reads it).
    reasoning: Text | None = None
    reasoning_content: Text | None = None
    tool_call_id: Text | None = None
    task: Text | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):  # vLLM joins text parts with newlines
            return "\n".join(part.text for part in self.content)
        return self.content or ""

    def template_fields(self) -> dict[str, str]:
        """The message as the chat template sees it (vLLM's ``_parse_chat_message_content``)."""
        fields = {"role": self.role, "content": self.text}
        if self.name is not None:
            fields["name"] = self.name
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if self.role == "assistant" and reasoning is not None:
            fields["reasoning"] = fields["reasoning_content"] = reasoning
        if self.role == "tool" and self.tool_call_id is not None:
            fields["tool_call_id"] = self.tool_call_id
        if self.task is not None:
            fields["task"] = self.task
        if self.role == "developer":  # vLLM gives every developer message its tools (refused)
            fields["tools"] = None
        return fields


# Names the renderer passes to the chat template itself: a template kwarg may not replace them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "add_generation_prompt", "tokenize", "bos_token", "eos_token", "tools"}
)


def _check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    if kwargs is None:
        return None
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise ValueError(f"{reserved[0]!r} is set by the server and cannot be overridden")
    return check_json_strings(kwargs)


TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_check_template_kwargs)]


class _ChatFields(StrictRequest):
    """What renders a conversation: shared by chat completions and ``/tokenize``."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: TemplateKwargs = None

    @field_validator("continue_final_message")
    @classmethod
    def _check_continue(cls, continue_final: bool, info: ValidationInfo) -> bool:
        if continue_final and info.data.get("add_generation_prompt"):
            raise ValueError("continue_final_message needs add_generation_prompt false")
        return continue_final


class ChatCompletionRequest(
    unsupported.refusing(unsupported.CHAT, _SamplingFields, "_ChatSamplingFields"), _ChatFields
):
    """``POST /v1/chat/completions``: messages rendered by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool = False
    # vLLM: the chat-templated prompt text at the response's root (and on the role chunks).
    return_prompt_text: bool = False

    # Cross-field checks sit on the later field (it sees the earlier ones in info.data), so the
    # error's location names a field.
    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        # vLLM: only a request for some (0 is the default) needs logprobs.
        if top_logprobs and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return top_logprobs

    @property
    def max_new_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    @property
    def num_logprobs(self) -> int | None:
        """Top-N per token, or None for no logprobs (the chosen token is always returned)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def response_role(self) -> str:
        """vLLM: the assistant answers after a generation prompt; without one the model continues
        the last message, whose role the response carries."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role


class TokenizeRequest(unsupported.refusing(unsupported.TOKENIZE, _ChatFields, "_TokenizeFields")):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, validate_default=True)
    # vLLM's defaults: True for a prompt, False for a conversation (its template adds them).
    add_special_tokens: bool | None = None
    # vLLM: also the token string of each id (the tokenizer's convert_ids_to_tokens).
    return_token_strs: bool = False

    @field_validator("messages")
    @classmethod
    def _one_input(cls, messages: list[ChatMessage] | None, info: ValidationInfo) -> list | None:
        if (info.data.get("prompt") is None) == (messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return messages

    @property
    def adds_special_tokens(self) -> bool:
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.messages is None


class DetokenizeRequest(StrictRequest):
    model: Text | None = None
    tokens: TokenIds
