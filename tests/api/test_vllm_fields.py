"""Fields and formats as vLLM's server gives them (the conventions its users rely on): echo of a
prompt with special tokens, /detokenize, chat message parts and names, ``return_token_ids``'s
prompt ids, prompt logprobs in a chat stream, and a stream's text equal to the non-streamed text
under stop strings with ``min_tokens``."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from corun.api import preprocess
from corun.api.protocol import ChatCompletionRequest
from corun.default_model import ASSETS_DIR
from corun.tokenizer import Tokenizer
from tests.api.client import post_ok, stream_chunks

pytestmark = pytest.mark.timeout(120)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]
IM_START = "<|im_start|>"  # the default model's special token 257


def test_echo_returns_the_prompt_as_sent_and_offsets_index_it(client: httpx.Client):
    prompt = f"{IM_START}Hi"
    choice = post_ok(client, COMPLETIONS, {"prompt": prompt, "max_tokens": 0, "echo": True,
                                         "logprobs": 0})["choices"][0]
    assert choice["text"] == prompt
    lp = choice["logprobs"]
    assert lp["tokens"] == [IM_START, "H", "i"]
    assert [prompt[o:o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"],
                                                 strict=True)] == lp["tokens"]
    # A token prompt is decoded with its special tokens.
    ids = post_ok(client, "/tokenize", {"prompt": prompt})["tokens"]
    choice = post_ok(client, COMPLETIONS, {"prompt": ids, "max_tokens": 0, "echo": True})
    assert choice["choices"][0]["text"] == prompt


def test_detokenize_keeps_special_tokens(client: httpx.Client):
    ids = post_ok(client, "/tokenize", {"prompt": f"{IM_START}Hi"})["tokens"]
    assert post_ok(client, "/detokenize", {"tokens": ids})["prompt"] == f"{IM_START}Hi"


def test_return_token_ids_gives_the_prompt_ids_once(client: httpx.Client):
    prompt_ids = post_ok(client, "/tokenize", {"prompt": "Hello"})["tokens"]
    body = {"prompt": "Hello", "max_tokens": 3, "seed": 1, "return_token_ids": True}
    choice = post_ok(client, COMPLETIONS, body)["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids and len(choice["token_ids"]) == 3
    chunks = stream_chunks(client, COMPLETIONS, body)
    given = [c["choices"][0]["prompt_token_ids"] for c in chunks if c["choices"]]
    assert given[0] == prompt_ids and all(g is None for g in given[1:])
    # Chat (vLLM >= 0.10.2): at the response's root, and at the root of each choice's role chunk.
    chat_ids = post_ok(client, "/tokenize", {"messages": MESSAGES})["tokens"]
    chat = {"messages": MESSAGES, "max_tokens": 2, "seed": 1, "return_token_ids": True, "n": 2}
    response = post_ok(client, CHAT, chat)
    assert response["prompt_token_ids"] == chat_ids
    assert all("prompt_token_ids" not in c for c in response["choices"])
    chunks = [c for c in stream_chunks(client, CHAT, chat) if c["choices"]]
    roles = [c for c in chunks if c["choices"][0]["delta"].get("role") == "assistant"]
    assert sorted(c["choices"][0]["index"] for c in roles) == [0, 1]
    assert all(c["prompt_token_ids"] == chat_ids for c in roles)
    assert all(c.get("prompt_token_ids") is None for c in chunks if c not in roles)
    # Without the flag, no ids.
    plain = post_ok(client, COMPLETIONS, {"prompt": "Hello", "max_tokens": 1})["choices"][0]
    assert plain.get("prompt_token_ids") is None


def test_chat_prompt_logprobs_sit_at_the_root(client: httpx.Client):
    """vLLM puts a chat response's prompt_logprobs at its root; a stream has them on the role
    chunk; and with continuous usage the role chunk counts no completion tokens yet."""
    body = {"messages": MESSAGES, "max_tokens": 2, "seed": 3, "prompt_logprobs": 1}
    response = post_ok(client, CHAT, body)
    whole = response["prompt_logprobs"]
    assert whole[0] is None and len(whole) > 1
    assert "prompt_logprobs" not in response["choices"][0]
    chunks = [c for c in stream_chunks(client, CHAT, {**body, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}) if c["choices"]]
    assert chunks[0]["prompt_logprobs"] == whole
    assert all(c.get("prompt_logprobs") is None for c in chunks[1:])
    assert chunks[0]["usage"]["completion_tokens"] == 0
    assert chunks[1]["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_stream_text_equals_the_response_text_with_stop_strings(client: httpx.Client, path: str):
    """Stop strings that occur in the text of the first min_tokens tokens: the stream's deltas
    and the response's text agree (a match must end in text past those tokens)."""
    base = {"prompt": "Hello"} if path == COMPLETIONS else {"messages": MESSAGES}
    free = post_ok(client, path, {**base, "max_tokens": 12, "temperature": 0})["choices"][0]
    text = free["text"] if path == COMPLETIONS else free["message"]["content"]
    assert len(text) >= 6, text
    stops = [text[1:3], text[4:6]]  # both inside the first tokens' text (byte-level model)
    body = {**base, "max_tokens": 12, "temperature": 0, "stop": stops, "min_tokens": 5}
    whole = post_ok(client, path, body)["choices"][0]
    whole_text = whole["text"] if path == COMPLETIONS else whole["message"]["content"]
    chunks = stream_chunks(client, path, body)
    deltas = [c["choices"][0]["text"] if path == COMPLETIONS
              else c["choices"][0]["delta"].get("content") or ""
              for c in chunks if c["choices"]]
    assert "".join(deltas) == whole_text
    assert text.startswith(whole_text) and len(whole_text) >= 4  # nothing cut inside the first 5


def test_stream_options_need_a_stream(client: httpx.Client):
    response = client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1,
                                              "stream_options": {"include_usage": True}})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "stream_options"


def test_chat_parts_join_with_newlines_and_names_reach_the_template():
    template = ("{% for m in messages %}[{{ m['role'] }}|{{ m.get('name', '') }}|"
                "{{ m['content'] }}]{% endfor %}")
    base = Tokenizer.from_dir(ASSETS_DIR)
    state = SimpleNamespace(tokenizer=Tokenizer(base.tokenizer, chat_template=template))
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "name": "alice",
         "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
        {"role": "assistant", "content": "C"}]})
    text = preprocess.render_chat(state, body.messages, False, False, None)
    assert text == "[user|alice|A\nB][assistant||C]"


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_an_over_long_chat_names_the_field_the_client_set(client: httpx.Client, field: str):
    response = client.post(CHAT, json={"messages": MESSAGES, field: 500})  # > max_model_len
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field
