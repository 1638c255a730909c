"""``continue_final_message``: the prompt ends exactly where the final message's content ends,
whatever that content shares with the chat template's own markup."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.timeout(120)

# ChatML, the default model's template: <|im_start|> is 257, <|im_end|> 258, bytes are their ids.
IM_START, IM_END = 257, 258
USER = [{"role": "user", "content": "hi"}]
PREFIX = [IM_START, *b"user\nhi", IM_END, 10, IM_START, *b"assistant\n"]
# Contents that also occur in the markup after them (<|im_end|>\n): cutting at their last
# occurrence in the rendered text would cut inside it.
CONTENTS = ["im", ">", "\n", "|", "end", "<", "", "hello im", "a\n\n", "assistant", "user\nhi"]


def _continued(client: httpx.Client, content: str) -> list[int]:
    body = {"messages": [*USER, {"role": "assistant", "content": content}],
            "add_generation_prompt": False, "continue_final_message": True}
    response = client.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


@pytest.mark.parametrize("content", CONTENTS, ids=[repr(c) for c in CONTENTS])
def test_continued_prompt_ends_with_the_final_content(client: httpx.Client, content: str):
    assert _continued(client, content) == [*PREFIX, *content.encode()]


def test_continued_prompt_is_what_chat_completions_prefill(client: httpx.Client):
    messages = [*USER, {"role": "assistant", "content": "im"}]
    body = {"messages": messages, "add_generation_prompt": False,
            "continue_final_message": True, "max_tokens": 1}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(PREFIX) + 2
    # Negative control: without continue_final_message the turn is closed by the template.
    closed = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert closed.json()["tokens"] == [*PREFIX, *b"im", IM_END, 10]
