"""Mixed prefill + decode steps of the dynamic schedules in the engine (CPU, torch backend, fp32).

A dynamic step's buffers put the step's decode tokens first (``num_decode_tokens``) and attention
runs them through the decode path. Checked here: the layout (decode tokens first, sample rows still
in the scheduler's chunk order), greedy outputs unchanged against the pre-split layout (every chunk
through prefill attention, in chunk order), and under batch_invariant every request's fingerprint
beside others equal to its fingerprint alone, for an MHA and an MLA model. For MLA the pre-split
layout is the negative control: a decode token through the expanded prefill path gets other bits
than through the absorbed decode path of a pure decode step.
"""

from __future__ import annotations

import pytest
import torch

from corun.config import EngineConfig
from corun.engine import LLMEngine
from corun.model_runner import ModelRunner, StepResult
from corun.outputs import RequestOutput
from corun.sampler import SamplingTensors, seed_to_int64
from corun.sampling_params import SamplingParams
from corun.scheduler import ScheduledChunk
from corun.step import StepPart
from models.forward_batch import ForwardBatch
from tests.engine.conftest import TINY

# Arrive together: the 20-token prompt is still prefilling (chunks of 8) while the short ones
# decode, so steps mix decode tokens with prefill chunks, in both chunk orders (the long prompt
# has the lowest seq id, so its chunk precedes the decode tokens in the scheduler's order).
REQUESTS = [
    ("long", list(range(30, 50)), 5),
    ("short", [7, 8], 6),
    ("mid", [3, 4, 5, 6, 9], 5),
]


def _legacy_step(runner: ModelRunner, part: StepPart) -> StepResult:
    """The pre-split layout: chunks in scheduler order, a decode token as a prefill chunk of 1,
    run and sampled outside the step buffers."""
    chunks, size = part.chunks, runner.config.block_size
    ids, positions, slots, cu, sample_rows = [], [], [], [0], []
    for chunk in chunks:
        seq = chunk.seq
        ids.extend(seq.token_ids[chunk.start:chunk.end])
        positions.extend(range(chunk.start, chunk.end))
        slots.extend(seq.block_table[p // size] * size + p % size
                     for p in range(chunk.start, chunk.end))
        cu.append(cu[-1] + chunk.num_tokens)
        if chunk.samples:
            sample_rows.append(cu[-1] - 1)
    tables = torch.zeros(len(chunks), runner.block_width, dtype=torch.int32)
    for i, chunk in enumerate(chunks):
        tables[i, : len(chunk.seq.block_table)] = torch.tensor(chunk.seq.block_table)
    batch = ForwardBatch(
        is_prefill=True, positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
        block_tables=tables, kv_cache=runner.kv_cache, ops=runner.ops,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        context_lens=torch.tensor([c.end for c in chunks], dtype=torch.int32),
        max_q_len=max(c.num_tokens for c in chunks), max_seq_len=runner.config.max_model_len,
        token_mask=torch.ones(cu[-1], dtype=torch.bool),
        context_lens_host=tuple(c.end for c in chunks))
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(ids), batch)[torch.tensor(sample_rows)]
        logits = runner.model.compute_logits(hidden, runner.ops)
        seqs = [c.seq for c in part.sampling_chunks]
        tensors = SamplingTensors(
            temperature=torch.tensor([s.params.temperature for s in seqs]),
            top_k=torch.tensor([s.params.effective_top_k for s in seqs], dtype=torch.int32),
            top_p=torch.tensor([s.params.top_p for s in seqs]),
            seeds=torch.tensor([seed_to_int64(s.seed) for s in seqs]),
            sample_indices=torch.tensor([s.sample_index for s in seqs], dtype=torch.int32),
            positions=torch.tensor([s.num_tokens for s in seqs]))
        tokens = runner.sampler.sample(logits, tensors)
        samples = torch.cat([tokens.view(-1, 1), runner.digest(logits)], dim=1)
    return StepResult(samples, logits, None, len(seqs))


class _Seen:
    """A chunk as the step saw it."""

    def __init__(self, chunk: ScheduledChunk) -> None:
        self.start, self.end, self.num_tokens = chunk.start, chunk.end, chunk.num_tokens
        self.is_decode, self.samples = not chunk.seq.is_prefilling, chunk.samples
        self.token_ids, self.block_table = list(chunk.seq.token_ids), list(chunk.seq.block_table)


def _snapshot(runner: ModelRunner, shape, host) -> dict:
    """The step's bound views, copied (the buffers are reused by the next step)."""
    bound = runner._bind(shape, runner.prefill_buffers, host)
    b = bound.batch
    copy = {name: getattr(b, name).clone() for name in
            ("positions", "block_tables", "cu_seqlens_q", "context_lens")}
    copy.update(ids=bound.input_ids.clone(), sample_rows=bound.sample_rows.clone(),
                seq_lens=None if b.seq_lens is None else b.seq_lens.clone(),
                num_decode_tokens=b.num_decode_tokens)
    return copy


def _run(mode: str, model: str = "tiny-qwen3", requests=REQUESTS, legacy: bool = False,
         record: list | None = None, **config) -> dict[str, RequestOutput]:
    engine = LLMEngine(EngineConfig(mode=mode, **dict(TINY, model=model, **config)))
    runner = engine.runner
    execute = runner.execute

    def recording_execute(part: StepPart) -> StepResult:
        seen = [_Seen(c) for c in part.chunks]  # the sequences change later: keep what it saw
        if legacy and part.shape.is_prefill:
            return _legacy_step(runner, part)
        result = execute(part)
        if record is not None and part.shape.is_prefill:
            host = runner.prefill_buffers.fill(part.shape, part.chunks)  # same values again
            record.append((seen, _snapshot(runner, part.shape, host)))
        return result

    runner.execute = recording_execute
    for request_id, prompt, max_tokens in requests:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                           request_id)
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def _mixed_steps(record: list) -> list:
    return [(chunks, views) for chunks, views in record if views["num_decode_tokens"] > 0]


def test_prepare_prefill_puts_decode_tokens_first():
    """In a mixed step the decode tokens lead, the chunks follow in order, and each sample row
    (in the scheduler's chunk order) is the last token of its chunk."""
    record: list = []
    _run("batch_invariant", record=record)
    mixed = _mixed_steps(record)
    assert mixed, "no mixed prefill + decode step was scheduled"
    reordered = 0
    for chunks, v in mixed:
        decodes = [c for c in chunks if c.is_decode]
        prefills = [c for c in chunks if not c.is_decode]
        reordered += chunks != decodes + prefills
        nd = v["num_decode_tokens"]
        assert nd == len(decodes)
        assert v["positions"][:nd].tolist() == [c.start for c in decodes]
        assert v["seq_lens"].tolist() == [c.end for c in decodes]
        assert v["context_lens"].tolist() == [c.end for c in prefills]
        cu = v["cu_seqlens_q"]
        assert (cu[1:] - cu[:-1]).tolist() == [c.num_tokens for c in prefills] and cu[0] == 0
        for chunk, row in zip([c for c in chunks if c.samples], v["sample_rows"].tolist(),
                              strict=True):
            assert int(v["positions"][row]) == chunk.end - 1
            assert int(v["ids"][row]) == chunk.token_ids[chunk.end - 1]
            table_row = (decodes + prefills).index(chunk)
            width = len(chunk.block_table)
            assert v["block_tables"][table_row, :width].tolist() == chunk.block_table
    assert reordered, "no mixed step had a prefill chunk before a decode token"


@pytest.mark.parametrize("mode", ["batch_invariant", "default"])
def test_mixed_steps_keep_greedy_outputs(mode):
    """On the torch backend the split layout gives the same greedy tokens as the pre-split one
    (and, under batch_invariant, the same fingerprints: there both paths are per-query)."""
    new, old = _run(mode), _run(mode, legacy=True)
    for request_id, *_ in REQUESTS:
        assert new[request_id].token_ids == old[request_id].token_ids, request_id
        if mode == "batch_invariant":
            assert new[request_id].fingerprint == old[request_id].fingerprint, request_id


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-deepseek-v3"])
def test_fingerprints_in_mixed_steps_equal_alone(model):
    """Under batch_invariant each request's fingerprint with others (mixed steps) equals its
    fingerprint alone."""
    record: list = []
    together = _run("batch_invariant", model, record=record)
    assert _mixed_steps(record), "no mixed prefill + decode step was scheduled"
    for request in REQUESTS:
        alone = _run("batch_invariant", model, requests=[request])[request[0]]
        assert together[request[0]].fingerprint == alone.fingerprint, request[0]


def test_mla_decode_token_through_prefill_path_differs_negative_control():
    """The check above can fail: for MLA without path invariance the pre-split layout (decode
    tokens through the expanded prefill path) changes the fingerprint of a request that decodes
    beside a prefill. (With it, a decode token through the prefill path keeps its bits.)"""
    legacy = _run("batch_invariant", "tiny-deepseek-v3", legacy=True, path_invariant=False)
    alone = {r[0]: _run("batch_invariant", "tiny-deepseek-v3", requests=[r],
                        path_invariant=False)[r[0]] for r in REQUESTS}
    assert any(legacy[r].fingerprint != alone[r].fingerprint for r in alone)


def test_tp_broadcast_buffer_carries_mixed_batch():
    """The tensor-parallel broadcast moves a step's filled buffer as bytes: a peer's buffer of the
    same layout, given those bytes, binds exactly the driver's views of a mixed batch."""
    record: list = []
    engine = LLMEngine(EngineConfig(mode="batch_invariant", **TINY))
    runner = engine.runner
    execute = runner.execute
    parts: list = []

    def recording(part):
        if part.shape.num_decode_tokens and not parts:
            parts.append(part)
            host = runner.prefill_buffers.fill(part.shape, part.chunks)
            peer = runner._buffers(*runner._prefill_buffer_capacity())
            peer.dev.copy_(runner.prefill_buffers.dev)  # what dist.broadcast delivers
            mine = runner._bind(part.shape, runner.prefill_buffers, host).batch
            theirs = runner._bind(part.shape, peer, host).batch
            # On the CPU the views are live: compare now, before the next step refills them.
            names = ("positions", "slot_mapping", "block_tables", "cu_seqlens_q",
                     "context_lens", "seq_lens", "token_mask")
            record.append(({n: getattr(mine, n).clone() for n in names} | {"batch": mine},
                           {n: getattr(theirs, n).clone() for n in names} | {"batch": theirs}))
        return execute(part)

    runner.execute = recording
    for request_id, prompt, max_tokens in REQUESTS:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                           request_id)
    while engine.has_unfinished_requests():
        engine.step()
    (mine, theirs), = record
    a, b = mine.pop("batch"), theirs.pop("batch")
    assert b.num_decode_tokens == a.num_decode_tokens > 0 and b.is_prefill
    for name in mine:
        assert torch.equal(theirs[name], mine[name]), name
    assert (b.max_q_len, b.max_seq_len) == (a.max_q_len, a.max_seq_len)
