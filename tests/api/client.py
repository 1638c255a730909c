"""HTTP helpers the API tests share: a JSON POST expected to succeed, and a streamed one read to
its ``[DONE]``."""

from __future__ import annotations

import json

import httpx


def post_ok(client: httpx.Client, path: str, body: dict) -> dict:
    """POST ``body`` as JSON; the response must be a 200, whose JSON is returned."""
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream_chunks(client: httpx.Client, path: str, body: dict) -> list[dict]:
    """POST ``body`` with ``stream: true``; the events must end with ``[DONE]``, and the chunks
    before it are returned, parsed."""
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        data = [line[len("data: "):] for line in response.iter_lines() if line]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]
