"""corun's ``overlap_prefill_decode``: a decode step carries one prefill step (packed or isolated),
run as a second forward (a second CUDA stream on a GPU, one after the other here).

Scheduler: combined steps are emitted, their two parts hold disjoint sequences, the prefill part
keeps corun's aligned chunks and its fixed shape and the decode part its B slots, the token
budget counts the overlapped prefill step. Engine (CPU, torch backend, fp32): every request's
fingerprint with overlap on equals overlap off and the target's fingerprint alone, beside co-
runners; a negative control shows
the comparison catches a decode-shape change on the combined path. Config: ValueError cases.
"""

from __future__ import annotations

import dataclasses

import pytest

from corun.config import EngineConfig
from corun.engine import LLMEngine
from corun.outputs import RequestOutput
from corun.sampling_params import SamplingParams
from corun.scheduler import Scheduler, SchedulerOutput
from corun.sequence import Sequence
from tests.engine.conftest import TINY

TARGET_PROMPT = [17, 3, 250, 9, 81, 44, 5, 128, 66, 7, 200, 31, 12]  # two chunks of 8
TARGET_PARAMS = SamplingParams(max_tokens=6, temperature=0.8, top_k=40, top_p=0.9, seed=1234)
# (request id, prompt, params): a short decoder that is running when the target prefills, a
# long prompt that prefills beside decodes, a greedy one arriving after the target.
CORUNNERS = [
    ("co0", [5, 6, 7], SamplingParams(max_tokens=9, seed=1)),
    ("co1", list(range(2, 23)), SamplingParams(max_tokens=5, temperature=1.0, seed=2)),
    ("co2", [40, 41, 42, 43, 44, 45], SamplingParams(max_tokens=7, temperature=0.0)),
]


def _sched_config(**kw) -> EngineConfig:
    kw.setdefault("prefill_policy", "isolated")
    return EngineConfig(**dict(dict(TINY, mode="corun", overlap_prefill_decode=True), **kw))


def _simulate(config: EngineConfig, prompt_lens: list[int], max_tokens: int,
              num_blocks: int = 64) -> tuple[list[SchedulerOutput], dict[int, list[int]]]:
    """Drive a Scheduler as the engine does (both parts of a step sample); returns the steps and,
    per sequence, the positions computed in order. Each step gets ``decoding_before``: whether a
    sequence was decoding when it was scheduled."""
    sched = Scheduler(config, num_blocks)
    for i, n in enumerate(prompt_lens):
        # Distinct prompts: the prefix cache would otherwise skip positions of later ones.
        sched.add(Sequence(i, f"r{i}", 0, [i + 1] * n, SamplingParams(max_tokens=max_tokens),
                           seed=1))
    steps, computed = [], {}
    while sched.has_unfinished():
        decoding = any(not s.is_prefilling for s in sched.running)
        out = sched.schedule()
        out.decoding_before = decoding
        for part in (out.chunks, out.overlap_chunks):
            samplers = [c.seq for c in part if c.samples]
            for chunk in part:
                computed.setdefault(chunk.seq.seq_id, []).extend(range(chunk.start, chunk.end))
            sched.commit_chunks(part)
            for seq in samplers:
                seq.append_token(2)
                if seq.num_output_tokens == max_tokens:
                    sched.finish(seq)
        steps.append(out)
        assert len(steps) < 500, "scheduler made no progress"
    return steps, computed


@pytest.mark.parametrize("policy", ["isolated", "packed"])
def test_scheduler_emits_combined_steps_with_disjoint_aligned_parts(policy):
    lengths = [3, 21, 6, 17, 9]
    steps, computed = _simulate(_sched_config(decode_batch_size=3, max_num_seqs=3,
                                              prefill_policy=policy, prefill_token_budget=8),
                                lengths, 4)
    combined = [out for out in steps if out.is_combined]
    assert len(combined) >= 3, "overlap on, but few decode steps carried a prefill chunk"
    for out in steps:
        if out.is_decode:
            assert out.num_decode_slots == 3 and 1 <= len(out.chunks) <= 3
        for chunk in out.prefill_chunks:  # aligned, in a combined step or alone
            assert policy == "packed" or len(out.prefill_chunks) == 1
            assert chunk.start % 8 == 0
            assert chunk.end % 8 == 0 or chunk.end == chunk.seq.num_prompt_tokens
        decode_ids = {c.seq.seq_id for c in out.decode_chunks}
        assert not decode_ids & {c.seq.seq_id for c in out.prefill_chunks}
    for seq_id, n in enumerate(lengths):  # every position computed once, in order
        assert computed[seq_id] == list(range(n + 3))


def test_prefill_chunking_is_unchanged_by_overlap():
    """A request's prefill chunks are the same (start, length) list with overlap on and off."""
    def chunks(overlap: bool) -> list[tuple[int, int]]:
        steps, _ = _simulate(_sched_config(overlap_prefill_decode=overlap), [3, 30, 9, 21], 4)
        return [(c.start, c.num_tokens) for out in steps for c in out.prefill_chunks
                if c.seq.seq_id == 3]

    assert chunks(True) == chunks(False) == [(0, 8), (8, 8), (16, 5)]


@pytest.mark.parametrize("steps_per_decode", [1, 2])
def test_stall_bound_counts_the_overlapped_prefill(steps_per_decode):
    """With a budget of ``n`` isolated 8-token steps, at most ``n - 1`` prefill-only steps run
    after a decode step that carried one (``n`` after one that found no prefill work), and that
    bound is reached."""
    steps, _ = _simulate(_sched_config(prefill_token_budget=8 * steps_per_decode),
                         [3, 30, 25, 17], 6)
    run, longest, carried = 0, 0, False
    for out in steps:
        if out.is_decode:
            run, carried = 0, out.is_combined
            continue
        run += 1
        if out.decoding_before:
            assert run <= steps_per_decode - int(carried)
            if carried:
                longest = max(longest, run)
    assert longest == steps_per_decode - 1 or steps_per_decode == 1


def _run(config: EngineConfig, requests: list[tuple[str, list[int], SamplingParams]],
         record: list[SchedulerOutput] | None = None) -> dict[str, RequestOutput]:
    engine = LLMEngine(config)
    if record is not None:
        schedule = engine.scheduler.schedule

        def recording_schedule() -> SchedulerOutput:
            out = schedule()
            record.append(out)
            return out

        engine.scheduler.schedule = recording_schedule
    for request_id, prompt, params in requests:
        engine.add_request(prompt, params, request_id)
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


@pytest.fixture(scope="module")
def alone() -> RequestOutput:
    config = EngineConfig(mode="corun", **TINY)
    return _run(config, [("target", TARGET_PROMPT, TARGET_PARAMS)])["target"]


@pytest.mark.parametrize("policy", ["packed", "isolated"])
@pytest.mark.parametrize("target_index", [1, 2])
def test_overlap_fingerprints_equal_overlap_off_and_alone(alone, target_index, policy):
    """Every request's fingerprint with overlap on equals overlap off, and the target's equals
    its fingerprint alone, with the target's prefill run beside decodes in combined steps."""
    requests = list(CORUNNERS)
    requests.insert(target_index, ("target", TARGET_PROMPT, TARGET_PARAMS))
    # One 8-token step per decode step, so the target's two chunks land in combined steps.
    base = EngineConfig(mode="corun", **dict(TINY, prefill_policy=policy, prefill_step_tokens=8,
                                             prefill_token_budget=8))
    # The reference alone runs the same step shapes (the fixture's ran T=16 packed steps).
    alone = _run(base, [("target", TARGET_PROMPT, TARGET_PARAMS)])["target"]
    steps: list[SchedulerOutput] = []
    on = _run(dataclasses.replace(base, overlap_prefill_decode=True), requests, steps)
    off = _run(base, requests)
    assert any(c.seq.request_id == "target" for out in steps if out.is_combined
               for c in out.overlap_chunks), "the target never prefilled beside a decode"
    assert any(c.seq.request_id == "target" for out in steps if out.is_combined
               for c in out.chunks), "the target never decoded beside a prefill"
    assert {k: v.fingerprint for k, v in on.items()} == {k: v.fingerprint for k, v in off.items()}
    assert on["target"].token_ids == alone.token_ids
    assert on["target"].fingerprint == alone.fingerprint


def test_overlap_fingerprint_negative_control(monkeypatch):
    """The comparison above can fail: decoding the combined steps at the live row count instead
    of B (CPU fp32 rows differ between M = 1 and M >= 2 in corun's GEMMs without path
    invariance; with it every row keeps its bits at any M) changes the target's fingerprint."""
    from corun.model_runner import ModelRunner
    from corun.step import StepPart, StepShape

    overlapped = ModelRunner.execute_overlapped

    def at_live_rows(self, decode, prefill):
        live = StepPart(StepShape.decode(len(decode.chunks)), decode.chunks)
        return overlapped(self, live, prefill)

    config = EngineConfig(mode="corun", path_invariant=False, **TINY)
    alone = _run(config, [("target", TARGET_PROMPT, TARGET_PARAMS)])["target"]
    monkeypatch.setattr(ModelRunner, "execute_overlapped", at_live_rows)
    requests = [CORUNNERS[0], ("target", TARGET_PROMPT, TARGET_PARAMS), *CORUNNERS[1:]]
    overlapped_config = dataclasses.replace(config, overlap_prefill_decode=True)
    assert _run(overlapped_config, requests)["target"].fingerprint != alone.fingerprint


@pytest.mark.parametrize("kw, match", [
    (dict(mode="default"), "overlap_prefill_decode"),
    (dict(mode="batch_invariant"), "overlap_prefill_decode"),
    (dict(mode="corun", tensor_parallel_size=2), "overlap_prefill_decode"),
])
def test_bad_config_raises(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**dict(TINY, overlap_prefill_decode=True, **kw))


def test_non_bool_raises():
    with pytest.raises(ValueError, match="overlap_prefill_decode: expected a bool"):
        EngineConfig(**dict(TINY, mode="corun", overlap_prefill_decode=1))
