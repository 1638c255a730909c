"""HTTP helpers the API tests share: a JSON POST expected to succeed, a streamed one read to its
``[DONE]``, and a POST over a bare socket that the test closes to leave."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager

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


@contextmanager
def raw_completion(base_url: str, body: dict) -> Iterator[socket.socket]:
    """POST ``body`` to ``/v1/completions`` over a bare socket, closed when the block exits: the
    client goes away then, and no HTTP library reads or retries anything before."""
    host, port = base_url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        yield sock
    finally:
        sock.close()
