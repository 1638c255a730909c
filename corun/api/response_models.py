"""OpenAI-compatible response models (pydantic v2), as vLLM's server sends them.

Plain (non-strict) models: the server builds them from trusted values. CoRun extensions, on every
choice: ``seed`` (the request's seed, the drawn one when the client gave none) and ``fingerprint``
(a hash of the sampled token ids), so a client can replay a request with the same seed and
compare. In ``corun`` and ``batch_invariant`` modes the replay is bitwise equal.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ErrorInfo(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob`` of a prompt position: a top-N token's rank is its place among them
    (1 the most likely); the prompt token's, when it is not among them, is its rank in the whole
    vocabulary (the number of tokens with a logprob at least its own, ties included)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# Per prompt position (null first): token id (as a string) -> its PromptLogprob.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # CoRun extensions: replay the choice with `seed`, compare with `fingerprint`.
    seed: int | None = None
    fingerprint: str | None = None
    token_ids: list[int] | None = None
    # vLLM's return_token_ids: the prompt's ids (a stream's first chunk of the choice only).
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # --enable-return-routed-experts, once finished: per token the model read (the prompt and
    # every sampled token but the last), per MoE layer, the top-k expert ids.
    routed_experts: list[list[list[int]]] | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    seed: int | None = None
    fingerprint: str | None = None
    token_ids: list[int] | None = None
    routed_experts: list[list[list[int]]] | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    # vLLM's return_token_ids and prompt_logprobs: at a chat response's root (one prompt).
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # vLLM's return_prompt_text: the chat-templated prompt.
    prompt_text: str | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    seed: int | None = None
    fingerprint: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    # On each choice's role chunk: the prompt's ids (vLLM) and its logprobs (vLLM refuses them
    # in a stream; here they come as the non-streamed response has them).
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_text: str | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "corun"
    root: str
    parent: str | None = None
    max_model_len: int
    permission: list[dict] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
