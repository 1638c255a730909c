"""Per-request logits processing (logit_bias, min_tokens, penalties, min_p) and best_of: each
processor against a hand computation, their effect through the engine, and bits independent of
co-running requests."""

from __future__ import annotations

import math

import pytest
import torch

from corun.llm import LLM
from corun.logits_processing import PenaltyPool, process_rows
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


def _reference_row(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """One row processed by itself, its penalties from the whole token lists on the indices of
    the tokens seen (the row-at-a-time form the batched, incremental one must match bit for
    bit)."""
    from collections import Counter

    params, out, device = seq.params, row.to(torch.float32).clone(), row.device
    vocab = out.shape[0]
    if seq.guide is not None:
        out = out.masked_fill(~seq.guide.allowed_mask(vocab).to(device), float("-inf"))
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.int64, device=device)
        out[ids] += torch.tensor(list(params.logit_bias.values()), device=device)
    if seq.num_output_tokens < params.min_tokens and seq.min_tokens_masked_ids:
        ids = torch.tensor(sorted(seq.min_tokens_masked_ids), dtype=torch.int64, device=device)
        out[ids[ids < vocab]] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.int64, device=device)
        values = out[seen]
        penalty = params.repetition_penalty
        out[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if seq.num_output_tokens and (params.frequency_penalty or params.presence_penalty):
        counts = sorted(Counter(seq.output_token_ids).items())
        ids = torch.tensor([t for t, _ in counts], dtype=torch.int64, device=device)
        count = torch.tensor([c for _, c in counts], dtype=torch.float32, device=device)
        out[ids] -= params.frequency_penalty * count + params.presence_penalty
    if params.min_p > 0.0 and not params.is_greedy:
        floor = out.max() + params.temperature * math.log(params.min_p)
        out = torch.where(out < floor, torch.full_like(out, float("-inf")), out)
    return out


def _process_one(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    return process_rows(row[None], [seq], PenaltyPool(row.device))[0]


# Values drawn from small sets, so that rows share them (one launch for the group) and differ.
REPETITION = (1.0, 1.0, 1.3, 0.8, 2.5)
FREQUENCY = (0.0, 0.0, 0.4, -0.3)
PRESENCE = (0.0, 0.7, -1.1)
MIN_P = (0.0, 0.0, 0.05, 0.3)


def _random_params(gen: torch.Generator, vocab: int) -> SamplingParams:
    def pick(values):
        return values[int(torch.randint(len(values), (1,), generator=gen))]

    bias = {}
    if torch.rand(1, generator=gen).item() < 0.3:
        ids = torch.randperm(vocab, generator=gen)[:3].tolist()
        bias = {t: pick((-5.0, 2.5, 0.125)) for t in ids}
    return SamplingParams(repetition_penalty=pick(REPETITION), frequency_penalty=pick(FREQUENCY),
                          presence_penalty=pick(PRESENCE), min_p=pick(MIN_P),
                          temperature=pick((0.0, 0.7, 1.0)), logit_bias=bias,
                          min_tokens=pick((0, 0, 3)), max_tokens=64)


def check_batched_processing(seed: int, device: str = "cpu", vocab: int = 97,
                             num_rows: int = 9, steps: int = 12) -> None:
    """Step after step, every row of a batch of mixed requests, processed all at once against
    the pool's incremental state, has the bits of that row processed by itself from its whole
    token lists; sequences finish (their pool rows are reused) and new ones join. On ``device``
    (tests/engine/test_gpu_engine.py runs it on CUDA at a real vocabulary)."""
    gen = torch.Generator().manual_seed(seed)
    pool = PenaltyPool(device)
    next_id = iter(range(10_000))

    def new_seq():
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 20, (1,), generator=gen)),),
                               generator=gen).tolist()
        masked = frozenset(torch.randint(0, vocab + 5, (2,), generator=gen).tolist())
        return Sequence(next(next_id), "r", 0, prompt, _random_params(gen, vocab), seed=0,
                        min_tokens_masked_ids=masked)

    seqs = [new_seq() for _ in range(num_rows)]
    for _ in range(steps):
        logits = torch.randn(len(seqs), vocab, generator=gen) * 4
        logits[:, torch.randint(0, vocab, (3,), generator=gen)] = 0.0  # the > 0 edge
        logits[:, torch.randint(0, vocab, (2,), generator=gen)] = -0.0
        logits = logits.to(device)
        got = process_rows(logits, seqs, pool)
        for i, seq in enumerate(seqs):
            want = _reference_row(logits[i], seq)
            assert torch.equal(got[i].view(torch.int32), want.view(torch.int32)), (i, seq.params)
        assert torch.equal(logits.view(torch.int32), logits.clone().view(torch.int32))
        for seq in seqs:  # one token, sometimes several
            for token in torch.randint(0, vocab, (int(torch.randint(1, 4, (1,), generator=gen)),),
                                       generator=gen).tolist():
                seq.append_token(token)
        for i in torch.randperm(len(seqs), generator=gen)[:2].tolist():  # two finish
            pool.release(seqs[i].seq_id)
            seqs[i] = new_seq()
    penalized = [s for s in seqs if s.params.repetition_penalty != 1.0
                 or s.params.frequency_penalty or s.params.presence_penalty]
    assert pool.num_live <= len(penalized) + 2 * steps


@pytest.mark.parametrize("seed", range(6))
def test_batched_processing_keeps_the_bits_of_one_row_alone(seed):
    check_batched_processing(seed)


@pytest.mark.parametrize("rows_per_block", [1, 4])
def test_blocks_of_rows_keep_the_bits_of_one_row_alone(rows_per_block, monkeypatch):
    import corun.logits_processing as logits_processing

    monkeypatch.setattr(logits_processing, "CPU_BLOCK_BYTES", rows_per_block * 4 * 97)
    check_batched_processing(7, num_rows=11)


def test_processing_launches_as_many_ops_for_many_rows_as_for_few():
    """Rows that share their params cost one launch per processor, not one per row: the aten ops
    of a step (counted by a dispatch mode) do not grow with the batch."""
    from experiments.bench_logits_processing import count_aten_ops

    params = SamplingParams(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1,
                            min_p=0.05, temperature=0.8, logit_bias={3: 1.0}, min_tokens=2)

    def ops(num_rows: int) -> int:
        pool = PenaltyPool("cpu")
        seqs = [Sequence(i, "r", 0, [1, 2, 3], params, seed=0,
                         min_tokens_masked_ids=frozenset({5})) for i in range(num_rows)]
        for seq in seqs:
            seq.append_token(7)
        process_rows(torch.randn(num_rows, 50), seqs, pool)  # the rows' first step
        for seq in seqs:
            seq.append_token(8)
        with count_aten_ops() as counter:
            process_rows(torch.randn(num_rows, 50), seqs, pool)
        return counter.count

    assert ops(128) == ops(2) <= 40


def test_the_pool_reuses_the_rows_of_finished_sequences():
    pool = PenaltyPool("cpu")
    params = SamplingParams(presence_penalty=1.0)
    first = [Sequence(i, "r", 0, [i], params, seed=0) for i in range(8)]
    for seq in first:
        seq.append_token(9)
    process_rows(torch.zeros(8, 16), first, pool)
    capacity = pool.counts.shape[0]
    for seq in first:
        pool.release(seq.seq_id)
    later = [Sequence(100 + i, "r", 0, [0], params, seed=0) for i in range(8)]
    out = process_rows(torch.zeros(8, 16), later, pool)
    assert pool.counts.shape[0] == capacity and pool.num_live == 8
    assert torch.equal(out, torch.zeros(8, 16))  # nothing of the earlier owners' tokens


def test_penalties_and_bias_match_a_hand_computation():
    row = torch.tensor([1.0, -2.0, 3.0, 0.5, -0.5, 2.0])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5,
                            logit_bias={5: -1.5})
    out = _process_one(row, _seq(params, prompt=[0, 1], output=[2, 2, 3]))
    # bias on 5; repetition on 0, 1, 2, 3 (prompt and output); frequency/presence on 2 (x2), 3.
    want = [1.0 / 2, -2.0 * 2, 3.0 / 2 - 0.25 * 2 - 0.5, 0.5 / 2 - 0.25 - 0.5, -0.5, 2.0 - 1.5]
    assert out.tolist() == pytest.approx(want)
    assert row.tolist() == [1.0, -2.0, 3.0, 0.5, -0.5, 2.0]  # the raw row is left alone


def test_min_tokens_masks_stop_ids_then_lets_them_through():
    row = torch.zeros(4)
    params = SamplingParams(min_tokens=2, max_tokens=4)
    early = _process_one(row, _seq(params, [0], [1], masked=frozenset({2, 3})))
    assert early.tolist() == [0.0, 0.0, -math.inf, -math.inf]
    late = _process_one(row, _seq(params, [0], [1, 1], masked=frozenset({2, 3})))
    assert late.tolist() == [0.0] * 4


def test_min_p_masks_tokens_below_its_share_of_the_top_one():
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(min_p=0.2, temperature=1.0)
    out = _process_one(row, _seq(params, [0], []))
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


def test_finished_and_aborted_sequences_give_their_penalty_rows_back(llm):
    engine = llm.engine
    pool = engine.runner.penalty_pool
    llm.generate([PROMPT, PROMPT[:3]], [SamplingParams(presence_penalty=0.5, max_tokens=4),
                                        SamplingParams(repetition_penalty=1.2, max_tokens=0)],
                 use_tqdm=False)
    assert pool.num_live == 0
    request_id = engine.add_request(PROMPT, SamplingParams(frequency_penalty=0.5, n=2,
                                                           max_tokens=50))
    while pool.num_live == 0:
        engine.step()
    engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert pool.num_live == 0


def test_engines_that_share_a_runner_keep_their_penalty_rows_apart():
    """Sequence ids come from the runner, so an engine dropped with a penalized request in
    flight leaves no row that the next engine's first sequence would take for its own."""
    from corun.config import EngineConfig
    from corun.engine import LLMEngine
    from corun.model_runner import ModelRunner

    config = EngineConfig(mode="corun", **TINY)
    runner = ModelRunner(config)
    params = SamplingParams(temperature=0, max_tokens=8, repetition_penalty=100.0)

    def run(engine: LLMEngine, prompt: list[int]) -> list[int]:
        engine.add_request(prompt, params, "x")
        finals = []
        while engine.has_unfinished_requests():
            finals.extend(o for o in engine.step() if o.finished)
        return finals[0].outputs[0].token_ids

    alone = run(LLMEngine(config, model_runner=runner), [9, 10, 11])
    dropped = LLMEngine(config, model_runner=runner)
    dropped.add_request(alone[:6], params, "left")
    for _ in range(4):
        dropped.step()
    assert runner.penalty_pool.num_live == 1
    assert run(LLMEngine(config, model_runner=runner), [9, 10, 11]) == alone


def test_the_profiled_step_processes_every_row_over_a_pool_of_as_many():
    """The workload the runner's memory profile measures on a GPU (profile_peak_bytes) runs on
    any device: every row penalized, one pool row each, the pool no larger."""
    from corun.logits_processing import run_largest_step
    from corun.sampler import Sampler

    pool = run_largest_step(Sampler("torch", torch.device("cpu")), 50, 12, torch.device("cpu"),
                            max_logprobs=5)
    assert pool.num_live == 12 and pool.counts.shape == (12, 50)
    assert pool.counts[:, 1].tolist() == [1.0] * 12 and pool.prompt_seen[:, 0].all()
