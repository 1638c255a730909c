"""Per-request logits processing (logit_bias, min_tokens, penalties, min_p) and best_of: each
processor against a hand computation, their effect through the engine, and bits independent of
co-running requests."""

from __future__ import annotations

import math

import pytest
import torch

from corun.llm import LLM
from corun.logits_processing import process_row
from corun.sampling_params import SamplingParams
from corun.sequence import Sequence
from tests.engine.conftest import TINY

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
OTHERS = [[7, 7, 7, 7], list(range(40, 61)), [11, 12]]


@pytest.fixture(scope="module")
def llm():
    with LLM(**TINY) as llm:
        yield llm


def _seq(params: SamplingParams, prompt: list[int], output: list[int],
         masked: frozenset[int] = frozenset()) -> Sequence:
    seq = Sequence(0, "r", 0, prompt, params, seed=0, min_tokens_masked_ids=masked)
    for token in output:
        seq.append_token(token)
    return seq


def _sparse_penalties(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The penalties as they were computed before PenaltyState: from the whole token lists, on
    the indices of the tokens seen (the reference the dense, incremental form must match)."""
    from collections import Counter

    params, out, device = seq.params, row.clone(), row.device
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.int64, device=device)
        values = out[seen]
        penalty = params.repetition_penalty
        out[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if seq.num_output_tokens:
        counts = sorted(Counter(seq.output_token_ids).items())
        ids = torch.tensor([t for t, _ in counts], dtype=torch.int64, device=device)
        count = torch.tensor([c for _, c in counts], dtype=torch.float32, device=device)
        out[ids] -= params.frequency_penalty * count + params.presence_penalty
    return out


def check_incremental_penalties(seed: int, device: str = "cpu", vocab: int = 97) -> None:
    """Step after step (one token, sometimes several, appended between rows), the dense state
    that follows the sequence gives every logit the bits the whole-list computation gives, on
    ``device`` (tests/engine/test_gpu_engine.py runs it on CUDA at a real vocabulary)."""
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(repetition_penalty=1.0 + torch.rand(1, generator=gen).item(),
                            frequency_penalty=torch.rand(1, generator=gen).item() - 0.3,
                            presence_penalty=0.7 * torch.rand(1, generator=gen).item())
    prompt = torch.randint(0, vocab, (12,), generator=gen).tolist()
    seq = _seq(params, prompt, [])
    for _ in range(30):
        row = torch.randn(vocab, generator=gen) * 4
        row[torch.randint(0, vocab, (3,), generator=gen)] = 0.0  # exact zeros: the > 0 edge
        row[torch.randint(0, vocab, (2,), generator=gen)] = -0.0
        row = row.to(device)
        got, want = process_row(row, seq), _sparse_penalties(row, seq)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # -0.0 too
        for token in torch.randint(0, vocab, (int(torch.randint(1, 4, (1,), generator=gen)),),
                                   generator=gen).tolist():
            seq.append_token(token)
    process_row(torch.zeros(vocab, device=device), seq)
    state = seq.penalty_state
    assert state.num_outputs == seq.num_output_tokens == int(state.counts.sum())
    assert state.seen.nonzero().view(-1).tolist() == sorted(set(seq.token_ids))


@pytest.mark.parametrize("seed", range(4))
def test_incremental_penalties_keep_the_bits_of_the_sparse_form(seed):
    check_incremental_penalties(seed)


def test_penalties_and_bias_match_a_hand_computation():
    row = torch.tensor([1.0, -2.0, 3.0, 0.5, -0.5, 2.0])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5,
                            logit_bias={5: -1.5})
    out = process_row(row, _seq(params, prompt=[0, 1], output=[2, 2, 3]))
    # bias on 5; repetition on 0, 1, 2, 3 (prompt and output); frequency/presence on 2 (x2), 3.
    want = [1.0 / 2, -2.0 * 2, 3.0 / 2 - 0.25 * 2 - 0.5, 0.5 / 2 - 0.25 - 0.5, -0.5, 2.0 - 1.5]
    assert out.tolist() == pytest.approx(want)
    assert row.tolist() == [1.0, -2.0, 3.0, 0.5, -0.5, 2.0]  # the raw row is left alone


def test_min_tokens_masks_stop_ids_then_lets_them_through():
    row = torch.zeros(4)
    params = SamplingParams(min_tokens=2, max_tokens=4)
    early = process_row(row, _seq(params, [0], [1], masked=frozenset({2, 3})))
    assert early.tolist() == [0.0, 0.0, -math.inf, -math.inf]
    late = process_row(row, _seq(params, [0], [1, 1], masked=frozenset({2, 3})))
    assert late.tolist() == [0.0] * 4


def test_min_p_masks_tokens_below_its_share_of_the_top_one():
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(min_p=0.2, temperature=1.0)
    out = process_row(row, _seq(params, [0], []))
    assert torch.isinf(out).tolist() == [False, False, False, True]  # 0.05 < 0.2 * 0.5


def test_logit_bias_forces_a_token(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5,
                                                logit_bias={77: 100.0}), use_tqdm=False)[0]
    assert out.token_ids == [77] * 5


def test_min_tokens_keeps_going_past_a_stop_token(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6),
                          use_tqdm=False)[0].token_ids
    stop = greedy[0]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, min_tokens=3,
                                                stop_token_ids=[stop]), use_tqdm=False)[0]
    assert len(out.token_ids) >= 3 and stop not in out.token_ids[:3]
    unbounded = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6,
                                                      stop_token_ids=[stop]), use_tqdm=False)[0]
    assert unbounded.token_ids == [stop]


def test_repetition_penalty_changes_a_repeating_greedy_output(llm):
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12),
                         use_tqdm=False)[0].token_ids
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself
    penalized = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12,
                                                      repetition_penalty=5.0),
                             use_tqdm=False)[0].token_ids
    assert penalized != plain


def test_best_of_returns_the_n_most_likely_samples(llm):
    all_four = llm.generate([PROMPT], SamplingParams(n=4, seed=11, max_tokens=5, logprobs=0),
                            use_tqdm=False)[0].outputs
    best = llm.generate([PROMPT], SamplingParams(n=2, best_of=4, seed=11, max_tokens=5),
                        use_tqdm=False)[0].outputs
    ranked = sorted(all_four, key=lambda c: (-c.cumulative_logprob, c.index))[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    assert [c.index for c in best] == [0, 1]
    assert best[0].logprobs is None  # ranked internally, not reported unless asked


PROCESSED = SamplingParams(temperature=0.9, seed=5, max_tokens=8, presence_penalty=0.7,
                           frequency_penalty=0.3, repetition_penalty=1.4, logit_bias={9: 3.0},
                           min_tokens=4, min_p=0.02, logprobs=2)


def test_processed_requests_do_not_depend_on_co_runners(llm):
    alone = llm.generate([PROMPT], PROCESSED, use_tqdm=False)[0]
    others = [SamplingParams(seed=1, max_tokens=6), SamplingParams(seed=2, presence_penalty=2.0,
                                                                  max_tokens=9),
              SamplingParams(temperature=0, max_tokens=3, logit_bias={1: 50.0})]
    mixed = llm.generate(OTHERS + [PROMPT], others + [PROCESSED], use_tqdm=False)[-1]
    assert mixed.token_ids == alone.token_ids
    assert mixed.outputs[0].fingerprint == alone.outputs[0].fingerprint
    assert mixed.outputs[0].top_logprobs == alone.outputs[0].top_logprobs
