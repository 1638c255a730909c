"""Completions, chat, streaming, seeds, n, logprobs and stops over real HTTP (corun mode)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.api.conftest import MAX_MODEL_LEN, Server

pytestmark = pytest.mark.timeout(120)


def _complete(client: httpx.Client, **body) -> dict:
    response = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _sse_events(response: httpx.Response) -> list[str]:
    """The data payloads of an SSE response, in order (blank separators dropped)."""
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line[len("data: ") :] for line in lines]


def test_health_and_models(client: httpx.Client):
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["corun-default"]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_completion_response_shape(client: httpx.Client):
    body = _complete(client, seed=3, return_token_ids=True)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "corun-default" and body["system_fingerprint"].startswith("fp_")
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["seed"] == 3
    assert choice["finish_reason"] in ("stop", "length")
    assert len(choice["fingerprint"]) == 64
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(b"Hello")
    assert usage["completion_tokens"] == len(choice["token_ids"]) <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    detok = client.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"]
    assert detok == choice["text"]
    tokens = client.post("/tokenize", json={"prompt": "Hello"}).json()
    assert tokens["tokens"] == list(b"Hello") and tokens["count"] == 5


def test_same_seed_same_output_other_seed_differs(client: httpx.Client):
    """A request replayed with its seed gives the same tokens and fingerprint."""
    first = _complete(client, seed=11, return_token_ids=True)["choices"][0]
    again = _complete(client, seed=11, return_token_ids=True)["choices"][0]
    other = _complete(client, seed=12, return_token_ids=True)["choices"][0]
    assert (again["token_ids"], again["text"], again["fingerprint"]) == (
        first["token_ids"],
        first["text"],
        first["fingerprint"],
    )
    # Negative control: the fingerprint does tell two samples apart.
    assert other["fingerprint"] != first["fingerprint"]
    # Seeds are 64-bit unsigned (the engine may draw one >= 2**63): the largest one is accepted.
    assert _complete(client, seed=2**64 - 1, max_tokens=1)["choices"][0]["seed"] == 2**64 - 1
    # vLLM takes any int64: a negative seed is the key of the same 64 bits, reported as given.
    sample = dict(max_tokens=6, temperature=1.0, return_token_ids=True)
    negative = _complete(client, seed=-1, **sample)["choices"][0]
    top = _complete(client, seed=2**64 - 1, **sample)["choices"][0]
    other = _complete(client, seed=-2, **sample)["choices"][0]
    assert negative["seed"] == -1 and len(negative["token_ids"]) == 6
    assert negative["token_ids"] == top["token_ids"] != other["token_ids"]


def test_drawn_seed_is_reported_and_replays(client: httpx.Client):
    """Without a seed the server draws one, reports it, and replaying with it reproduces."""
    drawn = _complete(client, return_token_ids=True)["choices"][0]
    assert isinstance(drawn["seed"], int)
    replay = _complete(client, seed=drawn["seed"], return_token_ids=True)["choices"][0]
    assert (replay["token_ids"], replay["fingerprint"]) == (
        drawn["token_ids"],
        drawn["fingerprint"],
    )


def test_stream_matches_non_stream(client: httpx.Client):
    """SSE chunks carry the same text as the whole response, a usage chunk, then [DONE]."""
    whole = _complete(client, seed=5)
    request = {
        "prompt": "Hello",
        "max_tokens": 8,
        "seed": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/completions", json=request) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    token_chunks = chunks[:-1]
    assert all(c["object"] == "text_completion" for c in token_chunks)
    assert "".join(c["choices"][0]["text"] for c in token_chunks) == whole["choices"][0]["text"]
    last = token_chunks[-1]["choices"][0]
    assert last["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert last["fingerprint"] == whole["choices"][0]["fingerprint"] and last["seed"] == 5
    assert all(c["choices"][0]["finish_reason"] is None for c in token_chunks[:-1])


def test_chat_stream_and_whole(client: httpx.Client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    whole = client.post(
        "/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 6, "seed": 9}
    ).json()
    assert whole["object"] == "chat.completion"
    message = whole["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    # The prompt is the ChatML rendering of the messages.
    rendered = client.post("/tokenize", json={"messages": messages}).json()["count"]
    assert whole["usage"]["prompt_tokens"] == rendered
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": messages, "max_completion_tokens": 6, "seed": 9, "stream": True},
    ) as r:
        events = _sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks)
    assert content == message["content"]
    assert chunks[-1]["choices"][0]["fingerprint"] == whole["choices"][0]["fingerprint"]


def test_n_samples_and_prompt_batch(client: httpx.Client):
    """n samples per prompt, prompts batched: choice index = prompt * n + sample."""
    body = _complete(client, prompt=["ab", "cd"], n=2, seed=21, max_tokens=4)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert all(c["seed"] == 21 for c in choices)
    assert len({c["fingerprint"] for c in choices}) == 4  # samples differ
    single = _complete(client, prompt="cd", n=2, seed=21, max_tokens=4)["choices"]
    assert [c["fingerprint"] for c in single] == [c["fingerprint"] for c in choices[2:]]


def test_logprobs(client: httpx.Client):
    body = _complete(client, seed=2, logprobs=1, max_tokens=5, return_token_ids=True)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(choice["token_ids"]) == len(lp["tokens"])
    assert all(x <= 0.0 for x in lp["token_logprobs"])
    chat = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 3,
            "seed": 2,
            "logprobs": True,
            "top_logprobs": 1,
        },
    ).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"]
    # The most likely token: its logprob is at least the sampled one's (seeded sampling at T=1
    # need not pick it).
    assert all(len(t["top_logprobs"]) == 1 for t in content)
    assert all(t["top_logprobs"][0]["logprob"] >= t["logprob"] for t in content)


def test_stop_token_ids_and_stop_strings(client: httpx.Client):
    """Stopping at a token or string seen in a seeded run cuts that run's output there."""
    base = _complete(client, seed=31, max_tokens=12, ignore_eos=True, return_token_ids=True)
    ids, text = base["choices"][0]["token_ids"], base["choices"][0]["text"]
    stop_id = ids[3]
    cut = _complete(
        client,
        seed=31,
        max_tokens=12,
        ignore_eos=True,
        return_token_ids=True,
        stop_token_ids=[stop_id],
    )["choices"][0]
    assert cut["token_ids"] == ids[: ids.index(stop_id) + 1]
    assert (cut["finish_reason"], cut["stop_reason"]) == ("stop", stop_id)
    stop_char = next(ch for ch in text[1:] if ch != "\ufffd" and ch.isprintable())
    cut = _complete(client, seed=31, max_tokens=12, ignore_eos=True, stop=[stop_char])["choices"][0]
    assert cut["text"] == text[: text.index(stop_char)]
    assert (cut["finish_reason"], cut["stop_reason"]) == ("stop", stop_char)
    kept = _complete(client, seed=31, max_tokens=12, ignore_eos=True, stop=[stop_char],
                     include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == text[: text.index(stop_char) + 1]


def test_openai_client(server: Server):
    """The official openai client talks to the server, streaming included."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model="corun-default", prompt="Hi", max_tokens=5, seed=4)
    assert completion.choices[0].model_extra["seed"] == 4
    chat = client.chat.completions.create(
        model="corun-default", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, seed=4
    )
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="corun-default",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        seed=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="corun-default", prompt="Hi", temperature=-1.0)
    assert info.value.body["param"] == "temperature"
