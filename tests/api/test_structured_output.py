"""Structured output over HTTP: ``response_format`` (json_object, json_schema) and vLLM's
``guided_json`` / ``guided_regex`` / ``guided_choice`` on both endpoints, streamed or not, through
the openai client too; 400s naming the field for bad schemas, conflicting fields and the
structured-output fields still refused."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.api.inprocess import build_engine, serve_in_thread

pytestmark = pytest.mark.timeout(240)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Reply in JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema",
                      "json_schema": {"name": "ab", "schema": SCHEMA, "strict": True}}
# Random weights write long JSON strings: these biases (applied after the grammar mask, so
# within what it allows) close strings and objects sooner.
SHORT_JSON_BIAS = {str(ord('"')): 6.0, str(ord("}")): 3.0}


@pytest.fixture(scope="module")
def served():
    engine, tokenizer = build_engine("--max-num-seqs", "8")
    with serve_in_thread(engine, tokenizer) as url:
        with httpx.Client(base_url=url, timeout=120.0) as client:
            yield client, url


def _post(client: httpx.Client, path: str, body: dict) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _assert_matches_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"a", "b"}, text
    assert type(value["a"]) is int and isinstance(value["b"], str) and len(value["b"]) <= 8


def _assert_400(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def test_chat_json_schema(served):
    client, _ = served
    for seed in range(3):
        body = {"messages": MESSAGES, "max_tokens": 80, "seed": seed,
                "response_format": JSON_SCHEMA_FORMAT}
        choice = _post(client, CHAT, body)["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        _assert_matches_schema(choice["message"]["content"])


def test_completions_json_object_and_guided_fields(served):
    client, _ = served
    out = _post(client, COMPLETIONS, {"prompt": "JSON: ", "max_tokens": 90, "seed": 1,
                                      "response_format": {"type": "json_object"},
                                      "logit_bias": SHORT_JSON_BIAS})["choices"][0]
    assert out["finish_reason"] == "stop" and isinstance(json.loads(out["text"]), dict)
    out = _post(client, COMPLETIONS, {"prompt": "JSON: ", "max_tokens": 80, "seed": 2,
                                      "guided_json": json.dumps(SCHEMA)})["choices"][0]
    _assert_matches_schema(out["text"])
    choices = ["alpha", "beta", "gamma delta"]
    outs = _post(client, COMPLETIONS, {"prompt": "pick ", "max_tokens": 12, "seed": 3, "n": 4,
                                       "guided_choice": choices,
                                       "guided_decoding_backend": "outlines"})["choices"]
    assert all(o["text"] in choices and o["finish_reason"] == "stop" for o in outs)
    out = _post(client, CHAT, {"messages": MESSAGES, "max_tokens": 12, "seed": 4,
                               "guided_regex": r"[A-Z][0-9]{2}-(x|yz)"})["choices"][0]
    assert re.fullmatch(r"[A-Z][0-9]{2}-(x|yz)", out["message"]["content"]), out
    # response_format "text" is no structured output: it may sit beside a guided field.
    out = _post(client, COMPLETIONS, {"prompt": "pick ", "max_tokens": 12, "seed": 5,
                                      "response_format": {"type": "text"},
                                      "guided_choice": choices})["choices"][0]
    assert out["text"] in choices


def test_streamed_json_schema_is_the_same_output(served):
    client, _ = served
    body = {"messages": MESSAGES, "max_tokens": 80, "seed": 7,
            "response_format": JSON_SCHEMA_FORMAT}
    whole = _post(client, CHAT, body)["choices"][0]["message"]["content"]
    text = ""
    with client.stream("POST", CHAT, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    assert text == whole
    _assert_matches_schema(text)


def test_openai_client_response_format(served):
    openai = pytest.importorskip("openai")
    _, url = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model="corun-default", messages=MESSAGES,
                                          max_tokens=80, seed=0,
                                          response_format=JSON_SCHEMA_FORMAT)
    assert chat.choices[0].finish_reason == "stop"
    _assert_matches_schema(chat.choices[0].message.content)
    picked = client.completions.create(model="corun-default", prompt="pick ", max_tokens=8,
                                       seed=1, extra_body={"guided_choice": ["yes", "no"]})
    assert picked.choices[0].text in ("yes", "no")


# (endpoint, fields, the param the 400 names, the message's start)
BAD = [
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "response_format.json_schema.schema: Field required"),
    (CHAT, {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema", "response_format.json_schema: unsupported or invalid JSON"),
    (COMPLETIONS, {"response_format": {"type": "grammar"}}, "response_format.type",
     "response_format.type: not supported"),
    (COMPLETIONS, {"guided_json": {"type": "nope"}}, "guided_json",
     "guided_json: unsupported or invalid JSON schema"),
    (COMPLETIONS, {"guided_json": "{oops"}, "guided_json", "guided_json: the schema is not valid"),
    (COMPLETIONS, {"guided_regex": "("}, "guided_regex",
     "guided_regex: cannot compile to a token grammar"),
    (COMPLETIONS, {"guided_choice": []}, "guided_choice", "guided_choice: List should have"),
    (COMPLETIONS, {"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice",
     "guided_choice: only one of"),
    (CHAT, {"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json",
     "guided_json: only one of"),
    (CHAT, {"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos",
     "ignore_eos: not supported with structured output"),
    (COMPLETIONS, {"guided_choice": ["a"], "min_tokens": 2}, "min_tokens",
     "min_tokens: not supported with structured output"),
    (COMPLETIONS, {"guided_grammar": "root ::= 'a'"}, "guided_grammar",
     "guided_grammar: not supported"),
    (COMPLETIONS, {"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"},
     "guided_decoding_backend", "guided_decoding_backend: not supported"),
    (CHAT, {"guided_whitespace_pattern": r"\s*"}, "guided_whitespace_pattern",
     "guided_whitespace_pattern: not supported"),
    (CHAT, {"structured_outputs": {"json": SCHEMA}}, "structured_outputs",
     "structured_outputs: not supported"),
]


@pytest.mark.parametrize("endpoint, fields, param, start", BAD,
                         ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_structured_requests_are_400s_naming_the_field(served, endpoint, fields, param,
                                                           start):
    client, _ = served
    base = {"prompt": "x"} if endpoint == COMPLETIONS else {"messages": MESSAGES}
    message = _assert_400(client.post(endpoint, json={**base, "max_tokens": 4, **fields}), param)
    assert message.startswith(start), message
    assert client.get("/health").status_code == 200
