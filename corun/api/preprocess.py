"""Turning one HTTP request body into engine submissions: parse, validate, tokenize, render.

Everything here is CPU work proportional to the request's size (JSON parsing and validation of a
body of up to ``--max-request-body-bytes``, tokenization, chat-template rendering, detokenizing an
echo), so the server runs it on a worker thread (``ServerState.run_blocking``), never on the event
loop that serves ``/health`` and every open stream. Each function raises ``APIError`` (400 naming
the field, 404 for an unknown model) and touches no engine state: the engine is only reached
through the engine loop once the request is whole.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError

from corun.api.errors import APIError, param_of, validation_error
from corun.api.response_models import random_id
from corun.sampling_params import SamplingParams

if TYPE_CHECKING:
    from corun.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
    from corun.api.server import ServerState

Model = TypeVar("Model", bound=BaseModel)


@dataclass
class Submission:
    """One engine request of an HTTP request: prompt ``prompt_index`` with its own params."""

    request_id: str
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    # A chat request's chat-templated prompt (vLLM's return_prompt_text).
    prompt_text: str | None = None


def parse(model: type[Model], body: bytes) -> Model:
    """The request model of a JSON body; APIError 400 for malformed JSON or a bad field."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        raise APIError(400, f"Malformed JSON body: {exc}", None) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def check_model(state: ServerState, model: str | None) -> None:
    """vLLM's rule: a request may name the served model or its root (the ``--model`` value)."""
    if model is not None and model not in state.model_names:
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves `{state.model_name}`.",
            "model",
            code="model_not_found",
        )


def encode(state: ServerState, prompt: str | list[int], field: str, add_special_tokens: bool
           ) -> list[int]:
    if isinstance(prompt, list):
        return list(prompt)
    if not prompt:
        raise APIError(400, f"{field}: expected a non-empty prompt", field)
    return state.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)


def _continue_marker(conversation: list[dict]) -> str:
    """A string in no message: its place in the rendered text is where the final message ends."""
    while True:
        marker = f"CORUNCONTINUE{secrets.token_hex(8)}"
        if not any(marker in m["content"] for m in conversation):
            return marker


def render_chat(
    state: ServerState,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    continue_final: bool,
    template_kwargs: dict | None,
) -> str:
    """The prompt text of a conversation, by the model's chat template.

    ``continue_final``: the prompt ends exactly at the end of the final message's content, so the
    model continues it. The final message is rendered with a unique marker appended and the text
    is cut at the marker: cutting at the last occurrence of the content instead would cut inside
    the template's own markup whenever the content also occurs there (``"im"``, ``">"``, ``"\\n"``
    in ``<|im_end|>\\n``).
    """
    conversation = [m.template_fields() for m in messages]
    marker = None
    if continue_final:
        marker = _continue_marker(conversation)
        conversation[-1] = {**conversation[-1], "content": conversation[-1]["content"] + marker}
    try:
        text = state.tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except ValueError as exc:
        raise APIError(400, str(exc), param_of(str(exc), "messages")) from None
    except TypeError as exc:  # a template kwarg of the wrong type for the template's use of it
        field = "chat_template_kwargs" if template_kwargs else "messages"
        raise APIError(400, f"{field}: the chat template failed: {exc}", field) from None
    except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
        raise APIError(400, f"messages: the chat template failed: {exc}", "messages") from None
    if marker is not None:
        cut = text.rfind(marker)
        if cut < 0:
            raise APIError(
                400,
                "continue_final_message: the chat template does not render the final message's "
                "content as given, so there is no place to continue it from",
                "continue_final_message",
            )
        text = text[:cut]
    return text


def sampling_params(
    state: ServerState,
    body: Any,
    prompt_ids: list[int],
    max_tokens: int | None,
    logprobs: int | None,
    field: str,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """SamplingParams for one prompt; ValueErrors become 400s naming the field. A field the
    request leaves out takes the server's default (``ServerState.default_sampling``) if it has
    one, max_tokens included, as vLLM applies a model's generation_config.json (a default, not
    a ceiling: vLLM PR #34063); ``ServerState.max_tokens_ceiling`` caps every request."""
    room = state.max_model_len - len(prompt_ids)
    defaults = state.default_sampling

    def given_or_default(name: str) -> Any:
        if name in defaults and name not in body.model_fields_set:
            return defaults[name]
        return getattr(body, name)

    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {state.max_model_len} tokens; the "
            f"prompt has {len(prompt_ids)}, which leaves no room to generate.",
            field,
        )
    if max_tokens is None:  # vLLM's get_max_tokens: the default, within the room left
        max_tokens = min(room, defaults.get("max_tokens", room))
    elif max_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {state.max_model_len} tokens. "
            f"However, you requested {len(prompt_ids) + max_tokens} tokens "
            f"({len(prompt_ids)} in the {field}, {max_tokens} in the completion).",
            # The field the client set: chat's max_completion_tokens wins over max_tokens.
            "max_completion_tokens"
            if getattr(body, "max_completion_tokens", None) is not None else "max_tokens",
        )
    if state.max_tokens_ceiling is not None:
        max_tokens = min(max_tokens, state.max_tokens_ceiling)
    try:
        params = SamplingParams(
            n=body.n,
            temperature=given_or_default("temperature"),
            top_p=given_or_default("top_p"),
            top_k=given_or_default("top_k"),
            max_tokens=max_tokens,
            seed=body.seed,
            stop=body.stop_list or None,
            stop_token_ids=body.stop_token_ids,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=given_or_default("repetition_penalty"),
            logit_bias=body.logit_bias_ids,
            min_tokens=body.min_tokens,
            min_p=given_or_default("min_p"),
            best_of=body.best_of,
            structured=body.structured,
        )
        state.validate(prompt_ids, params)
    except ValueError as exc:
        param = param_of(str(exc), field)
        param = field if param in ("prompt", "prompt_token_ids") else param
        raise APIError(400, str(exc), param) from None
    return params


def completion_prompt_logprobs(body: CompletionRequest) -> int | None:
    """vLLM: ``echo`` with ``logprobs`` returns the prompt's logprobs too (the top-N of both)."""
    echoed = body.logprobs if body.echo and body.logprobs is not None else None
    if body.prompt_logprobs is None:
        return echoed
    return max(body.prompt_logprobs, echoed or 0)


def completion_submissions(
    state: ServerState, body: CompletionRequest
) -> tuple[list[Submission], list[str]]:
    """The engine requests of a completion request, and per prompt the text ``echo`` puts first."""
    check_model(state, body.model)
    subs = []
    for index, prompt in enumerate(body.prompts):
        ids = encode(state, prompt, "prompt", body.add_special_tokens)
        params = sampling_params(state, body, ids, body.max_tokens, body.logprobs, "prompt",
                                 completion_prompt_logprobs(body))
        subs.append(Submission(random_id("req"), index, ids, params))
    # vLLM: a text prompt is echoed as sent, a token prompt decoded with its special tokens.
    echo = [("" if not body.echo else prompt if isinstance(prompt, str)
             else state.tokenizer.decode(sub.prompt_ids, skip_special_tokens=False))
            for prompt, sub in zip(body.prompts, subs, strict=True)]
    return subs, echo


def chat_submissions(state: ServerState, body: ChatCompletionRequest) -> list[Submission]:
    check_model(state, body.model)
    text = render_chat(
        state,
        body.messages,
        body.add_generation_prompt,
        body.continue_final_message,
        body.chat_template_kwargs,
    )
    ids = state.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    params = sampling_params(state, body, ids, body.max_new_tokens, body.num_logprobs, "messages",
                             body.prompt_logprobs)
    return [Submission(random_id("req"), 0, ids, params, text)]
