"""Zero train-generation mismatch, end to end: a sampled token's logprob, its top logprobs and the
fingerprint of its sample have the same bits when the engine sampled it (decode steps beside
co-runners), when ``LLM.score`` scores the finished sequence (teacher forcing: packed prefill
steps, other chunking, prefix-cache hits), and when the trainer forward
(``corun.training.Policy``) computes it with autograd, in every deterministic mode and family.

Hypothesis draws the workload (requests, prompt lengths, a shared prefix the cache can serve,
n, the chunk size, the prefill policy, a KV pool small enough to preempt); prompts and seeds come
from a generator seeded by the drawn seed. The CPU engine (torch backend) runs the drawn
scenarios; the Triton kernels (interpreter) run pinned ones (``test_onpolicy_triton.py``).
Negative controls: ``default`` and path invariance off here; a prefill whose attention splits
differ from the decode's and a decode GEMM that splits K there: each makes the check fail.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from corun.llm import LLM
from corun.sampling_params import SamplingParams
from corun.training import Policy

FAMILIES = ["tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-hy3"]
MODES = ["corun", "batch_invariant", "batch_invariant_tuned"]
BASE = dict(dtype="float32", device="cpu", max_num_seqs=4, max_model_len=96, block_size=4,
            max_num_batched_tokens=16, prefill_step_tokens=16, max_prefill_seqs_per_step=4,
            prefill_token_budget=16, decode_split_size=16)
TOP_N = 2


@dataclass(frozen=True)
class Workload:
    prompt_lens: tuple[int, ...]
    shared_prefix: int  # tokens every prompt starts with (prefix-cache hits)
    max_tokens: int
    n: int
    chunk: int
    isolated: bool
    tight_kv: bool
    seed: int


@st.composite
def workloads(draw) -> Workload:
    return Workload(
        prompt_lens=tuple(draw(st.lists(st.integers(1, 20), min_size=1, max_size=3))),
        shared_prefix=draw(st.sampled_from([0, 8, 16])),
        max_tokens=draw(st.integers(2, 6)), n=draw(st.sampled_from([1, 2])),
        chunk=draw(st.sampled_from([4, 8])), isolated=draw(st.booleans()),
        tight_kv=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)))


PINNED = Workload(prompt_lens=(21, 5, 13), shared_prefix=16, max_tokens=6, n=2, chunk=8,
                  isolated=False, tight_kv=True, seed=7)
# What the Triton interpreter runs: two prompts over a shared prefix, a few decode steps.
SMALL = Workload(prompt_lens=(13, 5), shared_prefix=8, max_tokens=4, n=1, chunk=8,
                 isolated=False, tight_kv=False, seed=7)


def _config(family: str, mode: str, w: Workload, **overrides) -> dict:
    config = dict(BASE, model=family, mode=mode, prefill_chunk_size=w.chunk, **overrides)
    if config.get("backend") == "triton":
        # The Triton kernels' smallest page; the batch-invariant modes cut chunks at the prefill
        # kernel's query tile (64 rows in fp32).
        config["block_size"] = 8
        if mode != "corun":
            config.update(prefill_chunk_size=64, max_num_batched_tokens=64)
    if mode == "corun":
        config["prefill_policy"] = "isolated" if w.isolated else "packed"
    if w.tight_kv:  # one max_model_len sequence and a bit: the co-runners preempt each other
        config["num_kv_blocks"] = BASE["max_model_len"] // config["block_size"] + 2
    return config


def _requests(w: Workload) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(w.seed)
    prefix = [rng.randrange(2, 256) for _ in range(w.shared_prefix)]
    prompts = [prefix + [rng.randrange(2, 256) for _ in range(n)] for n in w.prompt_lens]
    params = [SamplingParams(max_tokens=w.max_tokens, temperature=1.0, logprobs=TOP_N,
                             n=w.n, ignore_eos=True, seed=rng.getrandbits(63)) for _ in prompts]
    return prompts, params


def _bits(values) -> list[int]:
    return torch.tensor(values, dtype=torch.float32).view(torch.int32).tolist()


def _mismatches(config: dict, w: Workload) -> dict[str, int]:
    """Generate, score and train-forward the workload; per path, the samples whose bits differ
    from the generated ones."""
    prompts, params = _requests(w)
    with LLM(skip_tokenizer_init=True, **config) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        samples = [(p, s) for p, out in zip(prompts, outputs, strict=True) for s in out.outputs]
        scored = llm.score([p for p, _ in samples], [s.token_ids for _, s in samples],
                           logprobs=TOP_N, use_tqdm=False)
    policy = Policy(**config)
    trained = policy.completion_logprobs([p for p, _ in samples],
                                         [s.token_ids for _, s in samples])
    counts = {"scored": 0, "top": 0, "fingerprint": 0, "trainer": 0}
    for (_, sample), score, train in zip(samples, scored, trained, strict=True):
        counts["scored"] += _bits(sample.logprobs) != _bits(score.logprobs)
        counts["top"] += [list(t.items()) for t in sample.top_logprobs] != \
            [list(t.items()) for t in score.top_logprobs]
        counts["fingerprint"] += sample.fingerprint != score.fingerprint
        counts["trainer"] += _bits(sample.logprobs) != train.detach().view(torch.int32).tolist()
    return counts


NONE = {"scored": 0, "top": 0, "fingerprint": 0, "trainer": 0}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=2)  # x 12 (family, mode) pairs, each three engine runs of a workload
@given(w=workloads())
@example(w=PINNED)
def test_generated_scored_and_trained_logprobs_are_the_same_bits(family, mode, w):
    assert _mismatches(_config(family, mode, w, backend="torch"), w) == NONE


# -- negative controls -------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["tiny-qwen3", "tiny-deepseek-v3"])
def test_default_mode_differs_negative_control(family):
    """``default`` decodes at the live batch's M and its decode splits follow the batch: its
    sampled logprobs are not the scored ones."""
    counts = _mismatches(_config(family, "default", PINNED, backend="torch"), PINNED)
    assert counts["scored"] > 0 and counts["fingerprint"] > 0


def test_path_invariance_off_differs_negative_control():
    """corun without path invariance (a padded GEMM whose row bits follow M, a prefill that
    multiplies a chunk's queries together)."""
    counts = _mismatches(_config("tiny-qwen3", "corun", PINNED, backend="torch",
                                 path_invariant=False), PINNED)
    assert counts["scored"] > 0 and counts["trainer"] > 0
