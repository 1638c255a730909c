"""A model's generation_config.json as vLLM applies it (``--generation-config auto``): its
sampling values are the defaults of the fields a request leaves out, never of the fields it sets,
and so is its max_new_tokens (vLLM PR #34063: a default, not a ceiling); a folder named by
``--generation-config`` makes max_new_tokens cap every request; ``vllm`` turns them off; a bad
file stops the server before the engine is built."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from corun.sampling_params import generation_config_defaults
from corun.serve import build_parser, generation_defaults, max_tokens_ceiling
from tests.api.inprocess import build_engine, serve_in_thread

pytestmark = pytest.mark.timeout(120)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]

QWEN3_GENERATION_CONFIG = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                           "eos_token_id": [151645, 151643], "transformers_version": "4.51.0"}


def _folder(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_reads_the_sampling_keys_only(tmp_path: Path):
    folder = _folder(tmp_path, {**QWEN3_GENERATION_CONFIG, "max_new_tokens": 7,
                                "repetition_penalty": 1.05, "min_p": None})
    assert generation_config_defaults(folder) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                  "repetition_penalty": 1.05, "max_tokens": 7}
    assert generation_config_defaults(tmp_path / "absent") == {}
    _folder(tmp_path, {"top_p": 2.0})
    with pytest.raises(ValueError, match="^generation_config: .*top_p: expected"):
        generation_config_defaults(tmp_path)


def test_the_flag_names_where_defaults_come_from(tmp_path: Path):
    folder = _folder(tmp_path, QWEN3_GENERATION_CONFIG)
    parse = build_parser().parse_args
    assert generation_defaults(parse(["--model", str(folder)]))["temperature"] == 0.6
    assert generation_defaults(parse(["--model", str(folder), "--generation-config", "vllm"])) \
        == {}
    assert generation_defaults(parse(["--generation-config", str(folder)]))["top_k"] == 20
    assert generation_defaults(parse([])) == {}  # the embedded model has no file
    with pytest.raises(SystemExit, match="--generation-config"):
        generation_defaults(parse(["--generation-config", str(tmp_path / "nowhere")]))


@pytest.fixture(scope="module")
def served():
    engine, tokenizer = build_engine("--max-num-seqs", "4")
    with serve_in_thread(engine, tokenizer,
                         default_sampling={"temperature": 0.0, "max_tokens": 3}) as url:
        with httpx.Client(base_url=url, timeout=60.0) as client:
            yield client


def _choice(client: httpx.Client, **body) -> dict:
    response = client.post("/v1/completions", json={"prompt": "Hello", **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_defaults_fill_only_what_a_request_leaves_out(served: httpx.Client):
    greedy = _choice(served, temperature=0, max_tokens=3, return_token_ids=True)
    # No temperature: the default (greedy).
    defaulted = _choice(served, max_tokens=3, return_token_ids=True)
    assert defaulted["token_ids"] == greedy["token_ids"]
    # An explicit null is unset: the default applies too.
    assert _choice(served, temperature=None, max_tokens=3, return_token_ids=True)["token_ids"] \
        == greedy["token_ids"]
    # A value the request sets wins: sampled at temperature 1 with seeds, the draws differ.
    sampled = {tuple(_choice(served, temperature=1.0, seed=s, max_tokens=6,
                             return_token_ids=True)["token_ids"]) for s in range(4)}
    assert len(sampled) > 1


def _num_tokens(client: httpx.Client, path: str, **body) -> int:
    base = {"prompt": "Hello"} if path == COMPLETIONS else {"messages": MESSAGES}
    response = client.post(path, json={**base, "ignore_eos": True, **body})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["completion_tokens"]


def test_max_new_tokens_is_a_default_not_a_ceiling(served: httpx.Client):
    """vLLM (``auto``): max_new_tokens is what a request that leaves max_tokens out gets; one
    that sets it gets what it asked for. A completion's max_tokens is never left out (16)."""
    assert _num_tokens(served, CHAT) == 3
    assert _num_tokens(served, CHAT, max_tokens=5) == 5
    assert _num_tokens(served, CHAT, max_completion_tokens=5) == 5
    assert _num_tokens(served, COMPLETIONS, max_tokens=5) == 5
    assert _num_tokens(served, COMPLETIONS) == 16
    assert _num_tokens(served, COMPLETIONS, max_tokens=None) == 16


def test_a_generation_config_folder_caps_every_request():
    """vLLM: with ``--generation-config FOLDER`` its max_new_tokens caps every request."""
    engine, tokenizer = build_engine("--max-num-seqs", "4")
    with serve_in_thread(engine, tokenizer, default_sampling={"max_tokens": 3},
                         max_tokens_ceiling=3) as url, \
            httpx.Client(base_url=url, timeout=60.0) as client:
        assert _num_tokens(client, CHAT) == 3
        assert _num_tokens(client, CHAT, max_tokens=5) == 3
        assert _num_tokens(client, COMPLETIONS) == 3
        assert _num_tokens(client, COMPLETIONS, max_tokens=2) == 2


def test_the_ceiling_comes_from_a_folder_only(tmp_path: Path):
    folder = _folder(tmp_path, {"max_new_tokens": 7})
    parse = build_parser().parse_args
    assert max_tokens_ceiling(parse(["--generation-config", str(folder)]), {"max_tokens": 7}) == 7
    assert max_tokens_ceiling(parse(["--model", str(folder)]), {"max_tokens": 7}) is None
    assert max_tokens_ceiling(parse(["--generation-config", str(folder)]), {}) is None
