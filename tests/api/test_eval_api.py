"""What evaluation harnesses send: lm-evaluation-harness's loglikelihood request (echo, logprobs,
max_tokens 0), top-N logprobs, prompt_logprobs, penalties, logit_bias, min_tokens, min_p and
best_of over HTTP, against a direct forward of the served model where values are checked."""

from __future__ import annotations

import httpx
import pytest

from tests.api.inprocess import build_engine, serve_in_thread
from tests.models.helpers import engine_logprobs

pytestmark = pytest.mark.timeout(180)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
CONTEXT = "The capital of France is"
CONTINUATION = " Paris."


@pytest.fixture(scope="module")
def served():
    engine, tokenizer = build_engine("--max-num-seqs", "8")
    with serve_in_thread(engine, tokenizer) as url:
        with httpx.Client(base_url=url, timeout=60.0) as client:
            yield client, engine, tokenizer


def _post(client: httpx.Client, path: str, body: dict) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_lm_eval_loglikelihood_request_returns_prompt_logprobs(served):
    client, engine, tokenizer = served
    body = {"prompt": CONTEXT + CONTINUATION, "max_tokens": 0, "echo": True, "logprobs": 1,
            "temperature": 0}
    choice = _post(client, COMPLETIONS, body)["choices"][0]
    ids = tokenizer.encode(CONTEXT + CONTINUATION)
    lp = choice["logprobs"]
    assert choice["text"] == tokenizer.decode(ids)
    assert lp["tokens"] == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = engine_logprobs(engine, ids)
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        top = lp["top_logprobs"][i]
        best = ref[i - 1].argmax().item()
        best_text = tokenizer.decode([best], skip_special_tokens=False)
        assert top[best_text] == pytest.approx(ref[i - 1, best].item(), abs=1e-4)
        assert lp["tokens"][i] in top  # the prompt token is always listed
    # What the harness computes: the continuation's summed logprob and whether it is greedy.
    ctxlen = len(tokenizer.encode(CONTEXT))
    cont = sum(lp["token_logprobs"][ctxlen:])
    assert cont == pytest.approx(sum(ref[i - 1, ids[i]].item() for i in range(ctxlen, len(ids))),
                                 abs=1e-3)
    assert choice["finish_reason"] == "length"
    # max_tokens 1 (newer harness versions): the same prompt entries, then one generated token.
    one = _post(client, COMPLETIONS, {**body, "max_tokens": 1})["choices"][0]["logprobs"]
    assert one["token_logprobs"][: len(ids)] == lp["token_logprobs"]
    assert len(one["token_logprobs"]) == len(ids) + 1


def test_top_logprobs_are_the_n_most_likely_tokens(served):
    client, engine, tokenizer = served
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0, "logprobs": 4,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = _post(client, COMPLETIONS, body)["choices"][0]
    ids = [5, 6, 7, 8] + choice["token_ids"]
    ref = engine_logprobs(engine, ids)
    for step, top in enumerate(choice["logprobs"]["top_logprobs"]):
        row = ref[3 + step]
        want = row.topk(4)
        texts = [f"token_id:{t}" for t in want.indices.tolist()]
        assert list(top)[:4] == texts
        assert list(top.values())[:4] == pytest.approx(want.values.tolist(), abs=1e-4)
    chat = _post(client, CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                "seed": 4, "logprobs": True, "top_logprobs": 3})
    for token in chat["choices"][0]["logprobs"]["content"]:
        values = [t["logprob"] for t in token["top_logprobs"]]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert values[0] >= token["logprob"]


def test_prompt_logprobs_field(served):
    """vLLM's shape: per position the prompt token first, then the top-N ranked 1..N; the
    prompt token's rank is its rank in the whole vocabulary when it is not among them."""
    client, engine, _ = served
    prompt = [9, 10, 11, 12, 13, 200, 7, 65]
    choice = _post(client, COMPLETIONS, {"prompt": prompt, "max_tokens": 1,
                                         "prompt_logprobs": 2})["choices"][0]
    entries = choice["prompt_logprobs"]
    ref = engine_logprobs(engine, prompt)
    assert entries[0] is None and len(entries) == len(prompt)
    outside = 0
    for i, entry in enumerate(entries[1:], start=1):
        token, top = prompt[i], ref[i - 1].topk(2).indices.tolist()
        assert list(entry)[0] == str(token)
        assert [entry[str(t)]["rank"] for t in top] == [1, 2]
        assert list(entry)[1:] == [str(t) for t in top if t != token]
        want = ref[i - 1, token].item()
        assert entry[str(token)]["logprob"] == pytest.approx(want, abs=1e-4)
        if token not in top:
            outside += 1
            rank = int((ref[i - 1] >= ref[i - 1, token]).sum())
            assert entry[str(token)]["rank"] == rank
    assert outside > 0


def test_sampling_extras_over_http(served):
    client, _, _ = served
    forced = _post(client, COMPLETIONS, {"prompt": "x", "max_tokens": 4, "temperature": 0,
                                         "logit_bias": {"65": 100}, "return_token_ids": True})
    assert forced["choices"][0]["token_ids"] == [65] * 4
    base = {"prompt": "abc", "max_tokens": 6, "seed": 3, "presence_penalty": 1.0,
            "frequency_penalty": 0.5, "repetition_penalty": 1.2, "min_p": 0.05, "min_tokens": 2,
            "return_token_ids": True}
    first = _post(client, COMPLETIONS, base)["choices"][0]
    again = _post(client, COMPLETIONS, base)["choices"][0]
    assert first["token_ids"] == again["token_ids"] and first["fingerprint"] == again["fingerprint"]
    best = _post(client, COMPLETIONS, {"prompt": "abc", "max_tokens": 4, "seed": 8, "n": 2,
                                       "best_of": 3, "return_token_ids": True})["choices"]
    all_three = _post(client, COMPLETIONS, {"prompt": "abc", "max_tokens": 4, "seed": 8, "n": 3,
                                            "logprobs": 0, "return_token_ids": True})["choices"]
    ranked = sorted(all_three, key=lambda c: (-sum(c["logprobs"]["token_logprobs"]), c["index"]))
    assert [c["token_ids"] for c in best] == [c["token_ids"] for c in ranked[:2]]
    assert [c["index"] for c in best] == [0, 1]


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "guided_grammar": "root ::= 'a'"}, "guided_grammar"),
    ({"prompt": "x", "structured_outputs": {"json": {"type": "object"}}}, "structured_outputs"),
    ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
])
def test_limits_and_unsupported_fields_are_400s(served, body, field):
    client, _, _ = served
    response = client.post(COMPLETIONS, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    if field in ("guided_grammar", "structured_outputs", "use_beam_search"):
        assert error["message"].startswith(f"{field}: not supported: "), error["message"]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_scoring_has_the_sampled_tokens_bits(served, max_tokens):
    """An RL framework's re-score over HTTP (lm-eval's and verl's form: the prompt plus the
    completion, ``echo``, ``logprobs``, ``max_tokens`` 0 or 1) gives each completion token the
    very logprob the server reported when it sampled it (path invariance)."""
    client, _, tokenizer = served
    prompt = tokenizer.encode("Sample me, then score me:")
    sampled = _post(client, COMPLETIONS, {
        "prompt": prompt, "max_tokens": 10, "logprobs": 0, "temperature": 1.0, "seed": 21,
        "ignore_eos": True, "return_token_ids": True})["choices"][0]
    completion = sampled["token_ids"]
    echoed = _post(client, COMPLETIONS, {
        "prompt": prompt + completion, "max_tokens": max_tokens, "echo": True, "logprobs": 0,
        "temperature": 0})["choices"][0]["logprobs"]["token_logprobs"]
    scored = echoed[len(prompt):len(prompt) + len(completion)]
    assert scored == sampled["logprobs"]["token_logprobs"]


def test_top_logprobs_keys_as_vllm(served):
    """Top-logprob keys are each id's own decoded text, as vLLM: byte-level ids that decode to
    the same replacement character share a key, so a dict holds fewer than N; with
    ``return_tokens_as_token_ids`` every one of the N has its own key."""
    client, _, tokenizer = served
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0, "logprobs": 20}
    by_id = _post(client, COMPLETIONS, {**body, "return_tokens_as_token_ids": True})
    by_text = _post(client, COMPLETIONS, body)
    for ids_top, text_top in zip(by_id["choices"][0]["logprobs"]["top_logprobs"],
                                 by_text["choices"][0]["logprobs"]["top_logprobs"], strict=True):
        assert len(ids_top) >= 20
        ids = [int(key.removeprefix("token_id:")) for key in ids_top]
        texts = {tokenizer.decode([t], skip_special_tokens=False) for t in ids}
        assert set(text_top) == texts
