"""POST /update_weights_from_disk and /update_weights_from_tensor: the served engine takes new
weights without a restart, and then answers exactly as a fresh server on those weights (text,
fingerprint, system_fingerprint); requests in flight finish on the old weights (the update waits
for them); a bad update is a 400 naming the problem and changes nothing; an update while paused
with a request in flight is a 409; a trainer process shares tensors with no disk round trip.

In-process servers (``tests.api.inprocess``) over the embedded default model: A starts from
seed 0 and is updated to seed 1's weights, B is a fresh seed-1 server.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import httpx
import pytest
import torch

from corun.weight_transfer import serialize_tensors
from models import build_model
from models.loader import checkpoint_views
from tests.api.conftest import REPO_ROOT
from tests.api.inprocess import build_engine, serve_in_thread
from tests.models.helpers import save_named_checkpoint

pytestmark = pytest.mark.timeout(180)

REQUEST = {"prompt": "weights", "max_tokens": 12, "ignore_eos": True, "seed": 3,
           "temperature": 0.9}


def _complete(url: str, body: dict = REQUEST) -> tuple[str, str, str]:
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    return choice["choices"][0]["text"], choice["choices"][0]["fingerprint"], \
        choice["system_fingerprint"]


@pytest.fixture(scope="module")
def fresh() -> tuple[str, str]:
    """(text, fingerprint, system fingerprint) of REQUEST on a fresh seed-1 server."""
    engine, tokenizer = build_engine("--seed", "1")
    with serve_in_thread(engine, tokenizer) as url:
        return _complete(url)


@pytest.fixture
def server():
    engine, tokenizer = build_engine("--seed", "0")
    with serve_in_thread(engine, tokenizer) as url:
        yield url


def test_update_from_disk_answers_as_a_fresh_server(server, fresh, tmp_path):
    before = _complete(server)
    ckpt = save_named_checkpoint("corun-default", 1, tmp_path / "seed1")
    resp = httpx.post(f"{server}/update_weights_from_disk", json={"model_path": str(ckpt)},
                      timeout=60)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["success"] is True and body["system_fingerprint"] == fresh[2]
    assert _complete(server) == fresh
    assert before[:2] != fresh[:2]


@pytest.mark.parametrize("body, status, needle", [
    ({"model_path": "/no/such/dir"}, 400, "no checkpoint directory at /no/such/dir"),
    ({"model_path": "x", "abort_all_requests": True}, 400, "abort_all_requests: not supported"),
    ({"model_path": "x", "load_format": "pt"}, 400, "load_format: 'pt' not supported"),
    ({}, 400, "model_path"),
])
def test_bad_requests_change_nothing(server, body, status, needle):
    before = _complete(server)
    resp = httpx.post(f"{server}/update_weights_from_disk", json=body, timeout=60)
    assert resp.status_code == status, resp.text
    assert needle in resp.text
    assert _complete(server) == before


def test_another_model_s_checkpoint_is_a_400(server, tmp_path):
    before = _complete(server)
    ckpt = save_named_checkpoint("corun-default", 1, tmp_path / "wide", intermediate_size=512)
    resp = httpx.post(f"{server}/update_weights_from_disk", json={"model_path": str(ckpt)},
                      timeout=60)
    assert resp.status_code == 400 and resp.json()["success"] is False
    assert "describes another model: intermediate_size 512" in resp.json()["message"]
    assert _complete(server) == before


def test_a_request_in_flight_finishes_on_the_old_weights(server, fresh, tmp_path):
    """The update is sent after the stream's first token: it waits, the stream keeps the old
    weights' bits to its end, and the request after it gets the new ones."""
    stream_body = {**REQUEST, "max_tokens": 48, "stream": True}
    reference = _complete(server, {**REQUEST, "max_tokens": 48})
    ckpt = save_named_checkpoint("corun-default", 1, tmp_path / "seed1")
    result: dict = {}
    with httpx.Client(base_url=server, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=stream_body) as resp:
            text, lines = "", resp.iter_lines()
            for line in lines:
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
                    break  # the request has run a step on the old weights
            update = threading.Thread(target=lambda: result.update(httpx.post(
                f"{server}/update_weights_from_disk", json={"model_path": str(ckpt)},
                timeout=120).json()))
            update.start()
            for line in lines:
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        update.join(120)
    assert text == reference[0]
    assert result["success"] is True and result["system_fingerprint"] == fresh[2]
    assert _complete(server) == fresh


def test_an_update_while_paused_with_a_request_in_flight_is_a_409(server, tmp_path):
    reference = _complete(server, {**REQUEST, "max_tokens": 32})
    ckpt = save_named_checkpoint("corun-default", 1, tmp_path / "seed1")
    with httpx.Client(base_url=server, timeout=60) as client:
        with client.stream("POST", "/v1/completions",
                           json={**REQUEST, "max_tokens": 32, "stream": True}) as resp:
            text, lines = "", resp.iter_lines()
            for line in lines:
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
                    break
            assert client.post("/pause").status_code == 200
            try:
                conflict = client.post("/update_weights_from_disk",
                                       json={"model_path": str(ckpt)})
            finally:
                client.post("/resume")
            for line in lines:
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
    assert conflict.status_code == 409 and "paused" in conflict.json()["message"]
    assert text == reference[0]


_TRAINER = """
import json, sys, httpx, torch
from corun.weight_transfer import serialize_tensors
from models import build_model
from models.loader import checkpoint_views
model, _ = build_model("corun-default", dtype=torch.float32, device="cpu", seed=1)
payload = serialize_tensors(checkpoint_views(model))  # handles; model stays alive below
resp = httpx.post(sys.argv[1] + "/update_weights_from_tensor",
                  json={"serialized_named_tensors": payload}, timeout=120)
print(json.dumps({"status": resp.status_code, "body": resp.json(), "bytes": len(payload)}))
"""


def test_a_trainer_process_shares_its_tensors(server, fresh, tmp_path):
    """Another process (the trainer) serializes tensor handles, no weights, and the server
    loads them from shared memory."""
    log = tmp_path / "trainer.log"
    # Output to a file, not a pipe: torch's shared-memory manager, a daemon the trainer starts,
    # inherits the trainer's stdout and outlives it, so a pipe would not reach EOF.
    with open(log, "w") as out_file:
        run = subprocess.run([sys.executable, "-c", _TRAINER, server], cwd=REPO_ROOT,
                             stdout=out_file, stderr=subprocess.STDOUT, timeout=150)
    assert run.returncode == 0, log.read_text()[-3000:]
    out = json.loads(log.read_text().strip().splitlines()[-1])
    assert out["status"] == 200 and out["body"]["system_fingerprint"] == fresh[2]
    weights_bytes = sum(t.numel() * 4 for t in checkpoint_views(
        build_model("corun-default", dtype=torch.float32, device="cpu", seed=1)[0]).values())
    assert out["bytes"] < weights_bytes / 50  # handles, not the weights
    assert _complete(server) == fresh


def test_a_payload_naming_other_code_is_refused(server):
    import base64
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("not a tensor",))

    payload = base64.b64encode(pickle.dumps({"w": Evil()})).decode()
    resp = httpx.post(f"{server}/update_weights_from_tensor",
                      json={"serialized_named_tensors": payload}, timeout=60)
    assert resp.status_code == 400 and "builtins.print" in resp.json()["message"]
    resp = httpx.post(f"{server}/update_weights_from_tensor",
                      json={"serialized_named_tensors": "%%%"}, timeout=60)
    assert resp.status_code == 400 and "base64" in resp.json()["message"]


def test_a_serialized_update_of_the_wrong_shapes_is_a_400(server):
    before = _complete(server)
    weights = dict(checkpoint_views(build_model("corun-default", dtype=torch.float32,
                                                device="cpu", seed=1)[0]))
    weights["model.norm.weight"] = torch.ones(3)
    payload = serialize_tensors(weights)
    resp = httpx.post(f"{server}/update_weights_from_tensor",
                      json={"serialized_named_tensors": payload}, timeout=60)
    assert resp.status_code == 400 and "model.norm.weight" in resp.json()["message"]
    assert _complete(server) == before
