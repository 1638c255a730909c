"""What a request may hold: numbers within the engine's ranges, explicit nulls as "unset", valid
Unicode only, and no field the engine does not implement. Real HTTP against the shared server; it
must come out of every case serving normally."""

from __future__ import annotations

import json

import httpx
import pytest

from corun.api import unsupported
from tests.api.conftest import Server

pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def _assert_400(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    return error["message"]


def _assert_serving(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    ok = client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2, "seed": 1})
    assert ok.status_code == 200, ok.text


# (endpoint, body, field): each value is beyond what the engine can represent.
OUT_OF_RANGE = [
    (COMPLETIONS, {"top_k": 2**31}, "top_k"),
    (COMPLETIONS, {"top_k": 2**63}, "top_k"),
    (COMPLETIONS, {"top_k": 10**30}, "top_k"),
    (COMPLETIONS, {"top_k": 1e30}, "top_k"),
    (CHAT, {"top_k": 2**40}, "top_k"),
    (COMPLETIONS, {"max_tokens": 2**31}, "max_tokens"),
    (COMPLETIONS, {"max_tokens": 10**30}, "max_tokens"),
    (CHAT, {"max_completion_tokens": 2**63}, "max_completion_tokens"),
    (COMPLETIONS, {"n": 129}, "n"),
    (COMPLETIONS, {"n": 2**63}, "n"),
    (COMPLETIONS, {"seed": 2**64}, "seed"),
    (COMPLETIONS, {"seed": 10**30}, "seed"),
    (COMPLETIONS, {"logprobs": 2**31}, "logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (COMPLETIONS, {"temperature": 1e30}, "temperature"),
    (COMPLETIONS, {"top_p": 1e-45}, "top_p"),  # an fp32 0 on the device
    (COMPLETIONS, {"stop_token_ids": [2**63]}, "stop_token_ids[0]"),
    (COMPLETIONS, {"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    (COMPLETIONS, {"stop_token_ids": list(range(1025))}, "stop_token_ids"),
    (COMPLETIONS, {"stop": ["a"] * 65}, "stop"),
    (COMPLETIONS, {"prompt": [1, 2**63]}, "prompt[1]"),
]


@pytest.mark.parametrize(("endpoint", "fields", "param"), OUT_OF_RANGE,
                         ids=[f"{p}={list(f.values())[-1]!s:.20}" for _, f, p in OUT_OF_RANGE])
def test_numbers_beyond_the_engine_are_400_naming_the_field(client, endpoint, fields, param):
    base = {"prompt": "x"} if endpoint == COMPLETIONS else {"messages": MESSAGES}
    response = client.post(endpoint, json={**base, "max_tokens": 2, **fields})
    _assert_400(response, param)


def test_largest_representable_values_are_served(client: httpx.Client):
    """Negative control of the bounds: the largest value of each is accepted and served."""
    body = {"prompt": "x", "max_tokens": 2, "top_k": 2**31 - 1, "n": 2, "seed": 2**64 - 1,
            "top_p": 2.0**-126, "temperature": 100.0, "logprobs": 20}
    response = client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    _assert_serving(client)


# Lone surrogates, as a JSON client writes them (\ud800 escapes are valid JSON syntax).
SURROGATE = "\\ud800"
SURROGATE_BODIES = [
    (COMPLETIONS, f'{{"prompt": "a{SURROGATE}b"}}', "prompt"),
    (COMPLETIONS, f'{{"prompt": ["ok", "{SURROGATE}"]}}', "prompt[1]"),
    (COMPLETIONS, f'{{"prompt": "x", "model": "{SURROGATE}"}}', "model"),
    (COMPLETIONS, f'{{"prompt": "x", "stop": ["{SURROGATE}"]}}', "stop[0]"),
    (CHAT, f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}',
     "messages[0].content"),
    (CHAT, f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "{SURROGATE}"}}'
     f"]}}]}}", "messages[0].content[0].text"),
    (CHAT, f'{{"messages": [{{"role": "user", "content": "x", "name": "{SURROGATE}"}}]}}',
     "messages[0].name"),
    (CHAT, f'{{"messages": [{{"role": "user", "content": "x"}}], "model": "{SURROGATE}"}}',
     "model"),
    (CHAT, f'{{"messages": [{{"role": "user", "content": "x"}}], '
     f'"chat_template_kwargs": {{"k": "{SURROGATE}"}}}}', "chat_template_kwargs"),
    ("/tokenize", f'{{"prompt": "{SURROGATE}"}}', "prompt"),
    ("/tokenize", f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}',
     "messages[0].content"),
    ("/tokenize", f'{{"prompt": "x", "model": "{SURROGATE}"}}', "model"),
    ("/detokenize", f'{{"tokens": [1], "model": "{SURROGATE}"}}', "model"),
]


def test_lone_surrogates_are_400_naming_the_field(client: httpx.Client):
    for endpoint, raw, param in SURROGATE_BODIES:
        response = client.post(endpoint, content=raw.encode(),
                               headers={"content-type": "application/json"})
        message = _assert_400(response, param)
        assert "surrogate" in message, (endpoint, message)
    # Negative control: a valid surrogate pair (U+1F600) is a character like any other.
    pair = client.post(COMPLETIONS, content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}',
                       headers={"content-type": "application/json"})
    assert pair.status_code == 200, pair.text
    _assert_serving(client)


NULLABLE_COMPLETION = ["temperature", "top_p", "top_k", "n", "stream", "echo", "presence_penalty",
                       "frequency_penalty", "logprobs", "max_tokens", "stop", "seed", "logit_bias",
                       "stream_options", "user", "suffix", "best_of", "stop_token_ids", "model"]
NULLABLE_CHAT = ["temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty",
                 "logprobs", "top_logprobs", "max_tokens", "max_completion_tokens", "stop", "seed",
                 "logit_bias", "tools", "tool_choice", "response_format", "stream_options", "user",
                 "chat_template_kwargs", "model"]


def test_explicit_null_is_unset(client: httpx.Client):
    """Every nullable field sent as null answers exactly as the request without it."""
    base = {"prompt": "Hello", "max_tokens": 4, "seed": 3}
    plain = client.post(COMPLETIONS, json=base).json()["choices"][0]
    nulls = {field: None for field in NULLABLE_COMPLETION if field not in base}
    with_nulls = client.post(COMPLETIONS, json={**base, **nulls, "max_tokens": 4})
    assert with_nulls.status_code == 200, with_nulls.text
    assert with_nulls.json()["choices"][0]["fingerprint"] == plain["fingerprint"]
    # max_tokens: null is the default of 16, as if absent.
    default = client.post(COMPLETIONS, json={"prompt": "Hello", "seed": 3, "ignore_eos": True,
                                             "max_tokens": None})
    assert default.json()["usage"]["completion_tokens"] == 16
    chat = {"messages": MESSAGES, "max_completion_tokens": 4, "seed": 3}
    plain_chat = client.post(CHAT, json=chat).json()["choices"][0]
    chat_nulls = {field: None for field in NULLABLE_CHAT if field not in chat}
    response = client.post(CHAT, json={**chat, **chat_nulls})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["fingerprint"] == plain_chat["fingerprint"]
    # Nulls inside a message and in stream_options too.
    inner = {"messages": [{"role": "user", "content": "hi", "name": None}],
             "max_completion_tokens": 2, "stream": True,
             "stream_options": {"include_usage": None}}
    assert client.post(CHAT, json=inner).status_code == 200
    # stream_options without a stream: vLLM's 400, not options silently dropped.
    inner.pop("stream")
    assert "stream=true" in _assert_400(client.post(CHAT, json=inner), "stream_options")


def test_openai_client_sending_none(server: Server):
    """The openai client sends null for None: every such argument is accepted."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    none = dict(temperature=None, top_p=None, n=None, stop=None, seed=None,
                presence_penalty=None, frequency_penalty=None, logprobs=None)
    completion = client.completions.create(model="corun-default", prompt="Hi", max_tokens=3,
                                           echo=None, **none)
    assert completion.choices[0].finish_reason in ("stop", "length")
    chat = client.chat.completions.create(
        model="corun-default", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        top_logprobs=None, **none)
    assert chat.choices[0].message.role == "assistant"


# Realistic non-neutral values of the fields the engine does not implement (the list;
# response_format and guided_json/regex/choice are implemented: tests/api/test_structured_output).
UNSUPPORTED_VALUES = [
    (COMPLETIONS, "guided_grammar", "root ::= 'a'"),
    (CHAT, "structured_outputs", {"json": {"type": "object"}}),
    (COMPLETIONS, "guided_decoding_backend", "xgrammar"),
    (COMPLETIONS, "use_beam_search", True),
    (CHAT, "tool_choice", "auto"),
    (CHAT, "tools", [{"type": "function", "function": {"name": "f"}}]),
    (COMPLETIONS, "suffix", "tail"),
    (COMPLETIONS, "cache_salt", "tenant-a"),
    (CHAT, "request_id", "my-request-1"),
    (COMPLETIONS, "stream_interval", 4),
]


def _request(endpoint: str, **fields) -> dict:
    base = {"prompt": "x"} if endpoint == COMPLETIONS else {"messages": MESSAGES}
    return {**base, "max_tokens": 2, **fields}


def test_unsupported_fields_are_refused_by_name(client: httpx.Client):
    """Each field the engine does not implement: 400 "<field>: not supported", never a silent
    no-op; its neutral value (what clients send by default) is served."""
    cases = list(UNSUPPORTED_VALUES)
    # Every entry of the table, with a value that is nobody's neutral value.
    cases += [(COMPLETIONS, f, 12345) for f in unsupported.COMPLETIONS]
    cases += [(CHAT, f, 12345) for f in unsupported.CHAT]
    for endpoint, field, value in cases:
        response = client.post(endpoint, json=_request(endpoint, **{field: value}))
        message = _assert_400(response, field)
        assert message.startswith(f"{field}: not supported"), message
    for endpoint, table in ((COMPLETIONS, unsupported.COMPLETIONS), (CHAT, unsupported.CHAT)):
        neutral = {f: values[0] for f, values in table.items() if values}
        response = client.post(endpoint, json=_request(endpoint, **neutral))
        assert response.status_code == 200, response.text
    _assert_serving(client)


def test_unsupported_message_parts_are_refused_by_name(client: httpx.Client):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    parts = [{"role": "user", "content": [{"type": "text", "text": "see"}, image]}]
    message = _assert_400(client.post(CHAT, json={"messages": parts}),
                          "messages[0].content[1].type")
    assert "'image_url': not supported" in message
    calls = [{"role": "assistant", "content": "",
              "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f"}}]}]
    message = _assert_400(client.post(CHAT, json={"messages": [*MESSAGES, *calls]}),
                          "messages[1].tool_calls")
    assert message.startswith("messages[1].tool_calls: not supported")
    # Negative control: text parts are served.
    text = [{"role": "user", "content": [{"type": "text", "text": "see"}]}]
    assert client.post(CHAT, json={"messages": text, "max_tokens": 1}).status_code == 200


def test_responses_style_text_parts_render_as_text(client: httpx.Client):
    """vLLM parses ``input_text`` and ``output_text`` parts as text: the prompt is the one the
    same message with ``text`` parts gives."""
    def prompt_ids(kind: str) -> list[int]:
        messages = [{"role": "user", "content": [{"type": kind, "text": "see"},
                                                  {"type": kind, "text": "this"}]}]
        body = {"messages": messages, "max_tokens": 1, "return_token_ids": True}
        response = client.post(CHAT, json=body)
        assert response.status_code == 200, response.text
        return response.json()["prompt_token_ids"]

    assert prompt_ids("input_text") == prompt_ids("output_text") == prompt_ids("text")


def test_chat_template_kwargs_errors_name_it(client: httpx.Client):
    for kwargs in ({"messages": []}, {"add_generation_prompt": False}, {"tokenize": True}):
        response = client.post(CHAT, json={"messages": MESSAGES, "chat_template_kwargs": kwargs})
        message = _assert_400(response, "chat_template_kwargs")
        assert next(iter(kwargs)) in message
    response = client.post(CHAT, json={"messages": MESSAGES, "chat_template_kwargs": "x"})
    _assert_400(response, "chat_template_kwargs")
    # Negative control: a kwarg the template does not use is passed through harmlessly.
    ok = client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 1,
                                 "chat_template_kwargs": {"enable_thinking": False}})
    assert ok.status_code == 200, ok.text


def test_malformed_json_nesting_is_400(client: httpx.Client):
    deep = b"[" * 100_000 + b"]" * 100_000
    response = client.post(COMPLETIONS, content=deep, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    huge_int = b'{"prompt": "x", "top_k": ' + b"9" * 5000 + b"}"
    response = client.post(COMPLETIONS, content=huge_int,
                           headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    _assert_serving(client)


def _usage_and_delivered(events: list[str], index: int) -> list[tuple[int, int]]:
    """Per content chunk of choice ``index``: (its continuous usage, the token ids delivered to
    that choice so far). The engine may hand two tokens to one chunk when the stream falls
    behind a step, so the usage is checked against what was delivered, not chunk by chunk."""
    delivered, out = 0, []
    for event in events:
        chunk = json.loads(event)
        for choice in chunk["choices"]:
            if choice["index"] == index:
                delivered += len(choice["token_ids"])
                out.append((chunk["usage"]["completion_tokens"], delivered))
    return out


def test_stream_options_continuous_usage(client: httpx.Client):
    """continuous_usage_stats (with include_usage) puts the usage so far on every chunk."""
    body = {"prompt": "x", "max_tokens": 3, "ignore_eos": True, "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with client.stream("POST", COMPLETIONS, json=body) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["usage"] is not None for c in chunks)
    pairs = _usage_and_delivered(events[:-1], 0)
    assert pairs and all(usage == delivered for usage, delivered in pairs), pairs
    assert pairs[-1][1] == 3 and chunks[-1]["usage"]["completion_tokens"] == 3


def test_continuous_usage_is_per_choice(client: httpx.Client):
    """vLLM: with n > 1, a chunk's continuous usage is its own choice's tokens so far."""
    body = {"prompt": "x", "max_tokens": 3, "ignore_eos": True, "stream": True, "n": 2,
            "seed": 4, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with client.stream("POST", COMPLETIONS, json=body) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    for index in (0, 1):
        pairs = _usage_and_delivered(events[:-1], index)
        assert pairs and all(usage == delivered for usage, delivered in pairs), (index, pairs)
        assert pairs[-1][1] == 3, (index, pairs)
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 6  # the final total
