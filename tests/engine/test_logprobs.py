"""Top-N logprobs and prompt logprobs, offline: values against a direct forward of the model
(log_softmax of its logits), ranking and tie order, and bits independent of co-running requests."""

from __future__ import annotations

import pytest
import torch

from corun.llm import LLM
from corun.sampler import Sampler, top_token_ids
from corun.sampling_params import SamplingParams
from tests.engine.conftest import TINY
from tests.models.helpers import run_sequence

PROMPT = [1, 5, 9, 22, 7, 3, 11, 40, 2, 8, 13, 17, 19, 23, 29, 31, 37, 41, 43]  # 19: 2+ tiles
OTHERS = [[4, 4, 8], [100, 3, 7, 9, 11, 12, 13, 200, 201, 3, 5], list(range(30, 60))]


@pytest.fixture(scope="module")
def llm():
    with LLM(**TINY) as llm:
        yield llm


def _direct_logits(llm: LLM, prompt: list[int], decode: list[int]) -> list[torch.Tensor]:
    runner = llm.engine.runner
    with torch.inference_mode():
        return run_sequence(runner.model, torch.tensor(prompt), torch.tensor(decode), runner.ops,
                            max_seq_len=TINY["max_model_len"])


def test_top_token_ids_breaks_ties_by_lowest_id_and_orders_by_value():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0, float("-inf")],
                           [-0.0, 0.0, -3.0, -2.0, 1.0, -3.0]])
    assert top_token_ids(logits, 4).tolist() == [[1, 2, 4, 0], [4, 0, 1, 3]]
    # The same rows beside other rows or alone, at any k: the same prefix.
    alone = top_token_ids(logits[1:], 2)
    assert alone.tolist() == [[4, 0]]


def test_top_token_ids_in_blocks_of_rows_equal_the_whole(monkeypatch):
    import corun.sampler as sampler

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 40, generator=gen).round(decimals=1)  # ties
    whole = top_token_ids(logits, 7)
    monkeypatch.setattr(sampler, "TOP_IDS_BLOCK_BYTES", 2 * 8 * 40)  # blocks of 2 rows
    assert torch.equal(sampler.top_token_ids(logits, 7), whole)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sampler_logprobs_of_many_ids_share_the_row_log_softmax(backend):
    """[N, K] ids: every column has the bits of the [N] call on that column (one log-softmax
    of the row), and the values are an fp64 log-softmax's. (Checked against an independent
    reference: the torch backend *is* ``log_softmax(...).gather``, so comparing with that
    expression could not fail.)"""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([[1, 2, 3], [0, 49, 7], [5, 5, 6]])
    sampler = Sampler(backend, torch.device("cpu"))
    out = sampler.logprobs(logits, ids)
    assert out.shape == (3, 3) and out.dtype == torch.float32
    for k in range(ids.shape[1]):
        assert torch.equal(out[:, k], sampler.logprobs(logits, ids[:, k].contiguous())), k
    assert torch.equal(out[2, 0], out[2, 1])  # a repeated id: the same value
    want = torch.log_softmax(logits.double(), -1).gather(1, ids)
    assert torch.allclose(out.double(), want, rtol=0, atol=1e-5)


def test_top_logprobs_match_a_direct_forward(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    direct = _direct_logits(llm, PROMPT, out.token_ids[:-1])
    steps = [direct[0][-1]] + [d[0] for d in direct[1:]]
    assert len(out.top_logprobs) == len(out.logprobs) == 4
    for token, lp, top, logits in zip(out.token_ids, out.logprobs, out.top_logprobs, steps,
                                      strict=True):
        ref = torch.log_softmax(logits.double(), -1)
        want = ref.topk(5)
        assert list(top) == want.indices.tolist()  # most likely first
        assert list(top.values()) == pytest.approx(want.values.tolist(), abs=1e-4)
        assert lp == pytest.approx(ref[token].item(), abs=1e-4)
        assert top[token] == lp  # greedy: the sampled token is the top one, to the bit


def test_prompt_logprobs_match_a_direct_forward(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3),
                       use_tqdm=False)[0]
    ref = torch.log_softmax(_direct_logits(llm, PROMPT, [])[0].double(), -1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(PROMPT)
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        token = PROMPT[i]
        assert entry[token] == pytest.approx(ref[i - 1, token].item(), abs=1e-4)
        top = [t for t in entry][:3]
        assert top == ref[i - 1].topk(3).indices.tolist()
        assert len(entry) == 3 + (token not in top)


def _vocab_ranks(logprobs: torch.Tensor, prompt: list[int]) -> list[int | None]:
    """Per position, the number of entries of the full row at or above the prompt token's."""
    return [None] + [int((logprobs[i - 1] >= logprobs[i - 1, prompt[i]]).sum())
                     for i in range(1, len(prompt))]


def test_prompt_token_rank_is_its_rank_in_the_whole_vocabulary(llm):
    """The prompt token's rank is its rank in the whole vocabulary at every position, also
    where it is not among the top-N (vLLM's)."""
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    want = _vocab_ranks(torch.log_softmax(_direct_logits(llm, PROMPT, [])[0].double(), -1),
                        PROMPT)
    assert out.prompt_token_ranks == want
    assert max(want[1:]) > 1  # prompt tokens outside the top-1 are checked too


def test_prompt_token_rank_counts_ties(llm, monkeypatch):
    """``PromptScorer.score`` ranks the prompt token on its tile's own logits: the entries with a
    logprob at least its own, itself and every tie counted (vLLM V1's
    ``batched_count_greater_than``: ``(x >= values).sum(-1)``), in every tile (row i predicts
    token i + 1)."""
    runner = llm.engine.runner
    gen = torch.Generator().manual_seed(5)
    num_rows = 21  # two tiles, the second padded
    # Small integer logits: many exact ties, and no two distinct values that fp32 rounds together.
    table = torch.randint(0, 6, (num_rows, runner.vocab_size), generator=gen).float()
    prompt = torch.randint(0, runner.vocab_size, (num_rows + 1,), generator=gen).tolist()
    hidden = torch.arange(num_rows, dtype=torch.float32).view(-1, 1).expand(num_rows, 8)
    monkeypatch.setattr(runner.model, "compute_logits", lambda h, ops: table[h[:, 0].long()])
    ranks = runner.prompt_scorer.score(hidden, prompt, top_n=2).ranks
    assert ranks == _vocab_ranks(torch.log_softmax(table.double(), -1), prompt)


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(llm):
    scored, generated = llm.generate(
        [PROMPT, PROMPT],
        [SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=0),
         SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)], use_tqdm=False)
    assert scored.token_ids == [] and scored.finish_reason == "length"
    assert scored.prompt_logprobs == generated.prompt_logprobs
    assert len(generated.token_ids) == 2


def test_logprobs_bits_do_not_depend_on_co_runners(llm):
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=5, logprobs=4, prompt_logprobs=2)
    alone = llm.generate([PROMPT], params, use_tqdm=False)[0]
    mixed = llm.generate(OTHERS + [PROMPT], [SamplingParams(max_tokens=6, seed=1, logprobs=1,
                                                            prompt_logprobs=1)] * 3 + [params],
                         use_tqdm=False)[-1]
    assert mixed.outputs[0].token_ids == alone.outputs[0].token_ids
    assert mixed.outputs[0].logprobs == alone.outputs[0].logprobs
    assert mixed.outputs[0].top_logprobs == alone.outputs[0].top_logprobs
    assert mixed.prompt_logprobs == alone.prompt_logprobs


def test_more_logprobs_than_max_logprobs_is_refused(llm):
    with pytest.raises(ValueError, match="logprobs: 21 exceeds max_logprobs 20"):
        llm.generate([PROMPT], SamplingParams(logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs: 21 exceeds"):
        llm.generate([PROMPT], SamplingParams(prompt_logprobs=21), use_tqdm=False)


def test_prompt_logprobs_of_a_cached_prompt_are_computed_in_full():
    """With prefix caching on, a prompt already in the cache still gets every position's prompt
    logprobs (the request computes its whole prompt), the same bits as on an empty cache."""
    with LLM(**TINY, enable_prefix_caching=True) as llm:
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
        first = llm.generate([PROMPT], params, use_tqdm=False)[0]
        plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1),
                             use_tqdm=False)[0]
        again = llm.generate([PROMPT], params, use_tqdm=False)[0]
        assert llm.engine.stats()["prefix_cache_hits"] > 0  # the plain request did hit
    assert len(again.prompt_logprobs) == len(PROMPT)
    assert again.prompt_logprobs == first.prompt_logprobs
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == plain.outputs[0].token_ids
