"""Request fields and response shapes against vLLM's OpenAI server (a third review): /tokenize's
``return_token_strs`` and its ``add_special_tokens`` per input kind, the message fields vLLM hands
the chat template (``reasoning``, ``tool_call_id``), a chat response's role without a generation
prompt, ``return_prompt_text``, and fields that change the output or the response, which are
refused by name instead of ignored."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from corun.api import preprocess
from corun.api.protocol import ChatCompletionRequest
from corun.api.server import _tokenize
from corun.default_model import ASSETS_DIR
from corun.tokenizer import Tokenizer
from tests.api.client import post_ok, stream_chunks

pytestmark = pytest.mark.timeout(120)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]
# The default model's template, rendered for MESSAGES with the generation prompt.
CHAT_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def _assert_refused(response: httpx.Response, field: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field, error
    assert error["message"].startswith(f"{field}: not supported"), error


def test_ping_answers_get_and_post(client: httpx.Client):
    """vLLM serves /ping on GET and POST (SageMaker's health check), as /health."""
    assert client.get("/ping").status_code == 200
    assert client.post("/ping").status_code == 200


# -- /tokenize ------------------------------------------------------------------------------------


def test_tokenize_returns_token_strings_when_asked(client: httpx.Client):
    """vLLM's return_token_strs: the tokenizer's token of each id (convert_ids_to_tokens)."""
    vocab = Tokenizer.from_dir(ASSETS_DIR).tokenizer
    for body in ({"prompt": "Hi there"}, {"messages": MESSAGES}):
        plain = post_ok(client, "/tokenize", body)
        assert plain.get("token_strs") is None
        given = post_ok(client, "/tokenize", {**body, "return_token_strs": True})
        assert given["tokens"] == plain["tokens"]
        assert given["token_strs"] == [vocab.id_to_token(t) for t in given["tokens"]]
    assert post_ok(client, "/tokenize", {"prompt": "Hi there", "return_token_strs": True}
                 )["token_strs"] == ["H", "i", "Ġ", "t", "h", "e", "r", "e"]


def _bos_state() -> SimpleNamespace:
    """A server state whose tokenizer adds a BOS (<|endoftext|>, id 256) with special tokens."""
    base = Tokenizer.from_dir(ASSETS_DIR)
    config = {**base.config, "bos_token": "<|endoftext|>", "add_bos_token": True}
    return SimpleNamespace(tokenizer=Tokenizer(base.tokenizer, config), model_names={"m"},
                           max_model_len=128)


def test_tokenize_add_special_tokens_defaults_per_input_and_is_honoured():
    """vLLM: a prompt gets special tokens by default, a conversation does not (its template
    adds them); either way an explicit add_special_tokens is what the ids follow."""
    state = _bos_state()

    def ids(**body) -> list[int]:
        return _tokenize(state, json.dumps(body).encode()).tokens

    assert ids(prompt="Hi")[0] == 256
    assert ids(prompt="Hi", add_special_tokens=False)[0] != 256
    assert ids(messages=MESSAGES)[0] != 256
    assert ids(messages=MESSAGES, add_special_tokens=True)[0] == 256
    assert ids(messages=MESSAGES, add_special_tokens=True)[1:] == ids(messages=MESSAGES)


@pytest.mark.parametrize(("field", "value"), [
    ("chat_template", "{{ messages[0]['content'] }}"),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("mm_processor_kwargs", {"num_crops": 4}),
])
def test_tokenize_refuses_what_it_would_ignore(client: httpx.Client, field: str, value):
    _assert_refused(client.post("/tokenize", json={"messages": MESSAGES, field: value}), field)
    # Negative control: the neutral value is served.
    if field == "tools":
        assert client.post("/tokenize", json={"messages": MESSAGES, "tools": []}).status_code \
            == 200


# -- chat messages --------------------------------------------------------------------------------


def _render_with(template: str, messages: list[dict]) -> str:
    """``messages`` as the chat endpoint renders them, through ``template``."""
    base = Tokenizer.from_dir(ASSETS_DIR)
    state = SimpleNamespace(tokenizer=Tokenizer(base.tokenizer, chat_template=template))
    body = ChatCompletionRequest.model_validate({"messages": messages})
    return preprocess.render_chat(state, body.messages, False, False, None)


def test_message_reasoning_and_tool_call_id_reach_the_template():
    """vLLM passes an assistant message's reasoning (sent as reasoning or reasoning_content) to
    the template under both names, and a tool message's tool_call_id."""
    template = ("{% for m in messages %}[{{ m['role'] }}|{{ m.get('reasoning_content', '') }}|"
                "{{ m.get('reasoning', '') }}|{{ m.get('tool_call_id', '') }}|{{ m['content'] }}]"
                "{% endfor %}")
    text = _render_with(template, [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A", "reasoning_content": "R1"},
        {"role": "assistant", "content": "B", "reasoning": "R2"},
        {"role": "tool", "content": "T", "tool_call_id": "call-1"}])
    assert text == "[user||||Q][assistant|R1|R1||A][assistant|R2|R2||B][tool|||call-1|T]"


def test_message_task_and_developer_tools_reach_the_template_as_vllm_hands_them():
    """vLLM passes any message's task marker to the template, and every developer message's
    tools (None here: tools are refused), where the other roles have no tools at all."""
    template = ("{% for m in messages %}[{{ m['role'] }}|{{ m.get('task', '-') }}|"
                "{{ 'tools' in m }}|{{ (m['tools'] is none) if 'tools' in m else '' }}]"
                "{% endfor %}")
    text = _render_with(template, [
        {"role": "developer", "content": "D", "task": "search"},
        {"role": "user", "content": "Q", "task": "chat"},
        {"role": "assistant", "content": "A"}])
    assert text == "[developer|search|True|True][user|chat|False|][assistant|-|False|]"


def test_developer_message_tools_are_refused(client: httpx.Client):
    """vLLM renders a developer message's tools into the prompt: refused, as tools are."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    messages = [{"role": "developer", "content": "D", "tools": tools}, *MESSAGES]
    response = client.post(CHAT, json={"messages": messages, "max_tokens": 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].tools", error
    assert error["message"].startswith("messages[0].tools: not supported: tool calling"), error
    # Negative control: null is what vLLM hands the template when tools are absent.
    messages[0]["tools"] = None
    post_ok(client, CHAT, {"messages": messages, "max_tokens": 1})


def test_chat_role_without_generation_prompt_is_the_last_messages(client: httpx.Client):
    """vLLM: without the generation prompt the model continues the last message, so the response
    (and each choice's role chunk) carries that message's role."""
    body = {"messages": MESSAGES, "max_tokens": 2, "seed": 1, "add_generation_prompt": False}
    assert post_ok(client, CHAT, body)["choices"][0]["message"]["role"] == "user"
    roles = [c["choices"][0]["delta"].get("role") for c in stream_chunks(client, CHAT, body)
             if c["choices"]]
    assert roles[0] == "user" and all(r is None for r in roles[1:])
    # Negative control: with the generation prompt, the assistant answers.
    assert post_ok(client, CHAT, {**body, "add_generation_prompt": True}
                 )["choices"][0]["message"]["role"] == "assistant"


def test_return_prompt_text_gives_the_rendered_prompt(client: httpx.Client):
    """vLLM's return_prompt_text: the chat-templated prompt at the response's root, and on each
    choice's role chunk of a stream."""
    body = {"messages": MESSAGES, "max_tokens": 2, "seed": 1, "return_prompt_text": True}
    assert post_ok(client, CHAT, body)["prompt_text"] == CHAT_PROMPT
    chunks = [c for c in stream_chunks(client, CHAT, {**body, "n": 2}) if c["choices"]]
    roles = [c for c in chunks if c["choices"][0]["delta"].get("role")]
    assert len(roles) == 2 and all(c["prompt_text"] == CHAT_PROMPT for c in roles)
    assert all(c.get("prompt_text") is None for c in chunks if c not in roles)
    assert post_ok(client, CHAT, {**body, "return_prompt_text": False}).get("prompt_text") is None


def test_top_logprobs_zero_needs_no_logprobs(client: httpx.Client):
    """vLLM asks for logprobs only when top_logprobs asks for some (> 0, or -1): 0 is the
    default, which clients send as is."""
    body = {"messages": MESSAGES, "max_tokens": 1, "seed": 1, "top_logprobs": 0}
    assert post_ok(client, CHAT, body)["choices"][0]["logprobs"] is None
    response = client.post(CHAT, json={**body, "top_logprobs": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"
    given = post_ok(client, CHAT, {**body, "logprobs": True})["choices"][0]["logprobs"]
    assert given["content"][0]["top_logprobs"] == []


# -- stop_reason of an EOS ----------------------------------------------------------------------


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_stop_reason_of_an_eos_is_the_id_unless_it_is_the_tokenizers_own(client: httpx.Client,
                                                                         path: str):
    """vLLM: generation_config.json's EOS ids other than the tokenizer's own are stop ids, so
    <|endoftext|> (256) ends with stop_reason 256; the tokenizer's <|im_end|> (258) with null;
    ignore_eos goes past both. The bias makes the id the first token."""
    base = {"prompt": "Hi"} if path == COMPLETIONS else {"messages": MESSAGES}
    for token, stop_reason in ((256, 256), (258, None)):
        body = {**base, "max_tokens": 2, "seed": 1, "logit_bias": {str(token): 100},
                "return_token_ids": True}
        for choice in (post_ok(client, path, body)["choices"][0],
                       stream_chunks(client, path, body)[-1]["choices"][0]):
            assert choice["token_ids"][-1:] == [token]
            assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_reason)
        ignored = post_ok(client, path, {**body, "ignore_eos": True})["choices"][0]
        assert ignored["token_ids"] == [token] * 2
        assert (ignored["finish_reason"], ignored["stop_reason"]) == ("length", None)


# -- fields that would be ignored -----------------------------------------------------------------

# vLLM (and OpenAI) fields that change the tokens, the logprobs or the response when set.
IGNORED_BEFORE = [
    (COMPLETIONS, "logprob_token_ids", [1, 2]),
    (CHAT, "logprob_token_ids", [1, 2]),
    (COMPLETIONS, "watermarking", True),
    (CHAT, "repetition_detection", {"max_pattern_size": 8, "min_count": 3}),
    (COMPLETIONS, "thinking_token_budget", 100),
    (CHAT, "ec_transfer_params", {"do_remote_decode": True}),
    (CHAT, "verbosity", "low"),
]


@pytest.mark.parametrize(("endpoint", "field", "value"), IGNORED_BEFORE,
                         ids=[f"{'chat' if e == CHAT else 'completions'}-{f}"
                              for e, f, _ in IGNORED_BEFORE])
def test_fields_that_would_be_ignored_are_refused(client: httpx.Client, endpoint, field, value):
    base = {"prompt": "x"} if endpoint == COMPLETIONS else {"messages": MESSAGES}
    _assert_refused(client.post(endpoint, json={**base, "max_tokens": 1, field: value}), field)


# -- skip_special_tokens --------------------------------------------------------------------------


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_skip_special_tokens_false_keeps_them_in_the_text(client: httpx.Client, path: str):
    """vLLM's skip_special_tokens (default true): false keeps special tokens in the output text,
    streamed or not. <|im_start|> (257) is special and no EOS; the bias makes it every token."""
    base = {"prompt": "Hi"} if path == COMPLETIONS else {"messages": MESSAGES}
    body = {**base, "max_tokens": 2, "seed": 1, "logit_bias": {"257": 100}}

    def text(choice: dict) -> str:
        return choice["text"] if path == COMPLETIONS else choice["message"]["content"]

    assert text(post_ok(client, path, body)["choices"][0]) == ""
    kept = {**body, "skip_special_tokens": False}
    assert text(post_ok(client, path, kept)["choices"][0]) == "<|im_start|>" * 2
    deltas = [c["choices"][0]["text"] if path == COMPLETIONS
              else c["choices"][0]["delta"].get("content") or ""
              for c in stream_chunks(client, path, kept) if c["choices"]]
    assert "".join(deltas) == "<|im_start|>" * 2
