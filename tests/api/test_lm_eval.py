"""lm-evaluation-harness against the server, as the README runs it: ``lm_eval --model
local-completions --model_args ...,tokenizer_backend=remote`` over a loglikelihood task (multiple
choice) and a generation task, local datasets, the tokenizer read through ``GET /tokenizer_info``,
``/tokenize`` and ``/detokenize``. Each choice's loglikelihood is checked against a direct forward
of the served model, its ``is_greedy`` against that forward's argmax; each generation against the
server's answer to the same request sent directly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.api.inprocess import build_engine, serve_in_thread
from tests.models.helpers import engine_logprobs

pytestmark = pytest.mark.timeout(300)

DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
    {"question": "The sky is", "choices": ["blue", "green", "made of cheese"], "answer": 0},
]

TASK_YAML = """\
task: corun_toy
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

GENERATION_YAML = """\
task: corun_toy_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_tokens}
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
GENERATED_TOKENS = 6


@pytest.fixture(scope="module")
def served():
    engine, tokenizer = build_engine("--max-num-seqs", "8")
    with serve_in_thread(engine, tokenizer) as url:
        yield url, engine, tokenizer


def test_tokenizer_info(served):
    url, _, tokenizer = served
    info = httpx.get(f"{url}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == tokenizer.eos_token
    assert info["chat_template"] == tokenizer.chat_template
    assert info["tokenizer_class"]
    assert "added_tokens_decoder" not in info


def _run_lm_eval(url: str, tmp_path: Path, task: str) -> list[dict]:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf-cache")}
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
               f"model=corun-default,base_url={url}/v1/completions,tokenizer_backend=remote",
               "--tasks", task, "--include_path", str(tmp_path),
               "--output_path", str(tmp_path / "out"), "--log_samples"]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    samples = [json.loads(line) for path in (tmp_path / "out").rglob(f"samples_{task}_*.jsonl")
               for line in path.read_text().splitlines()]
    assert len(samples) == len(DOCS)
    return samples


def test_lm_eval_loglikelihood_task(served, tmp_path: Path):
    url, engine, tokenizer = served
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tmp_path / "corun_toy.yaml").write_text(TASK_YAML.format(data=data))
    for sample in _run_lm_eval(url, tmp_path, "corun_toy"):
        doc = sample["doc"]
        context = doc["question"]
        for choice, (loglikelihood, is_greedy) in zip(doc["choices"], sample["filtered_resps"],
                                                      strict=True):
            # The harness's split: the whole text encoded, the context's ids taken off its front.
            whole = tokenizer.encode(context + " " + choice, add_special_tokens=False)
            n_context = len(tokenizer.encode(context, add_special_tokens=False))
            ref = engine_logprobs(engine, whole)
            expected = sum(ref[i - 1, whole[i]].item() for i in range(n_context, len(whole)))
            greedy = all(ref[i - 1].argmax().item() == whole[i]
                         for i in range(n_context, len(whole)))
            assert float(loglikelihood) == pytest.approx(expected, abs=1e-3), (context, choice)
            assert (is_greedy == "True") == greedy, (context, choice)


def test_lm_eval_generation_task(served, tmp_path: Path):
    url, _, tokenizer = served
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tmp_path / "corun_toy_gen.yaml").write_text(
        GENERATION_YAML.format(data=data, max_tokens=GENERATED_TOKENS))
    texts = []
    for sample in _run_lm_eval(url, tmp_path, "corun_toy_gen"):
        # What the harness sends for a generate_until request (greedy, its fixed seed, its stop
        # strings plus the tokenizer's EOS).
        direct = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "corun-default", "prompt": sample["doc"]["question"],
            "max_tokens": GENERATED_TOKENS, "temperature": 0, "seed": 1234,
            "stop": ["\n", tokenizer.eos_token]}).json()
        assert sample["resps"][0][0] == direct["choices"][0]["text"]
        texts.append(sample["resps"][0][0])
    assert any(texts)  # something was generated, not only stopped at once
