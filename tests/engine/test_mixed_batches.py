"""Mixed prefill + decode steps of the dynamic schedules in the engine (CPU, torch backend, fp32).

``prepare_prefill`` puts the step's decode tokens first (``num_decode_tokens``) and attention runs
them through the decode path. Checked here: the layout (decode tokens first, sample rows still in
the scheduler's chunk order), greedy outputs unchanged against the pre-split layout (every chunk
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
from corun.model_runner import ModelRunner
from corun.outputs import RequestOutput
from corun.sampling_params import SamplingParams
from corun.scheduler import ScheduledChunk
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


def _legacy_prepare_prefill(runner: ModelRunner, chunks: list[ScheduledChunk]
                            ) -> tuple[torch.Tensor, ForwardBatch, list[int]]:
    """The pre-split layout: chunks in scheduler order, a decode token as a prefill chunk of 1."""
    ids, positions, slots, cu, sample_rows = [], [], [], [0], []
    for chunk in chunks:
        seq = chunk.seq
        ids.extend(seq.token_ids[chunk.start:chunk.end])
        positions.extend(range(chunk.start, chunk.end))
        slots.extend(runner._slot(seq.block_table, p) for p in range(chunk.start, chunk.end))
        cu.append(cu[-1] + chunk.num_tokens)
        if chunk.samples:
            sample_rows.append(cu[-1] - 1)
    batch = ForwardBatch(
        is_prefill=True, positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
        block_tables=runner._block_tables([c.seq.block_table for c in chunks], len(chunks)),
        kv_cache=runner.kv_cache, ops=runner.ops,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        context_lens=torch.tensor([c.end for c in chunks], dtype=torch.int32),
        max_q_len=max(c.num_tokens for c in chunks),
        max_seq_len=runner._max_seq_len(max(c.end for c in chunks)),
        token_mask=torch.ones(cu[-1], dtype=torch.bool))
    return torch.tensor(ids), batch, sample_rows


class _Seen:
    """A chunk as prepare_prefill saw it."""

    def __init__(self, chunk: ScheduledChunk) -> None:
        self.start, self.end, self.num_tokens = chunk.start, chunk.end, chunk.num_tokens
        self.is_decode, self.samples = not chunk.seq.is_prefilling, chunk.samples
        self.token_ids, self.block_table = list(chunk.seq.token_ids), list(chunk.seq.block_table)


def _run(mode: str, model: str = "tiny-qwen3", requests=REQUESTS, legacy: bool = False,
         record: list | None = None) -> dict[str, RequestOutput]:
    engine = LLMEngine(EngineConfig(mode=mode, **dict(TINY, model=model)))
    runner = engine.runner
    prepare = runner.prepare_prefill
    if legacy:
        prepare = lambda chunks: _legacy_prepare_prefill(runner, chunks)  # noqa: E731

    def recording_prepare(chunks):
        result = prepare(chunks)
        if record is not None:  # the sequences change later: keep what the step saw
            record.append(([_Seen(c) for c in chunks], result))
        return result

    runner.prepare_prefill = recording_prepare
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
    return [(chunks, result) for chunks, result in record if result[1].num_decode_tokens > 0]


def test_prepare_prefill_puts_decode_tokens_first():
    """In a mixed step the decode tokens lead, the chunks follow in order, and each sample row
    (in the scheduler's chunk order) is the last token of its chunk."""
    record: list = []
    _run("batch_invariant", record=record)
    mixed = _mixed_steps(record)
    assert mixed, "no mixed prefill + decode step was scheduled"
    reordered = 0
    for chunks, (ids, batch, sample_rows) in mixed:
        decodes = [c for c in chunks if c.is_decode]
        prefills = [c for c in chunks if not c.is_decode]
        reordered += chunks != decodes + prefills
        nd = batch.num_decode_tokens
        assert nd == len(decodes)
        assert batch.positions[:nd].tolist() == [c.start for c in decodes]
        assert batch.seq_lens.tolist() == [c.end for c in decodes]
        assert batch.context_lens.tolist() == [c.end for c in prefills]
        q_lens = (batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1]).tolist()
        assert q_lens == [c.num_tokens for c in prefills] and batch.cu_seqlens_q[0] == 0
        for chunk, row in zip([c for c in chunks if c.samples], sample_rows, strict=True):
            assert int(batch.positions[row]) == chunk.end - 1
            assert int(ids[row]) == chunk.token_ids[chunk.end - 1]
            table_row = (decodes + prefills).index(chunk)
            width = len(chunk.block_table)
            assert batch.block_tables[table_row, :width].tolist() == chunk.block_table
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
    """The check above can fail: for MLA the pre-split layout (decode tokens through the expanded
    prefill path) changes the fingerprint of a request that decodes beside a prefill."""
    legacy = _run("batch_invariant", "tiny-deepseek-v3", legacy=True)
    alone = {r[0]: _run("batch_invariant", "tiny-deepseek-v3", requests=[r])[r[0]]
             for r in REQUESTS}
    assert any(legacy[r].fingerprint != alone[r].fingerprint for r in alone)


def test_tp_step_packing_carries_mixed_batch():
    """pack_step / unpack_step (the tensor-parallel broadcast) rebuild a mixed batch exactly."""
    from types import SimpleNamespace

    from corun.tp_executor import pack_step, unpack_step

    record: list = []
    _run("batch_invariant", record=record)
    ids, batch, rows = _mixed_steps(record)[0][1]
    runner = SimpleNamespace(block_width=batch.block_tables.shape[1], kv_cache=batch.kv_cache,
                             ops=batch.ops)
    header, packed = pack_step(ids, batch, rows)
    assert packed.numel() == header.packed_len(runner.block_width)
    got_ids, got = unpack_step(header, packed, runner)
    assert torch.equal(got_ids, ids) and list(header.sample_rows) == rows
    assert got.num_decode_tokens == batch.num_decode_tokens and got.is_prefill
    for name in ("positions", "slot_mapping", "block_tables", "cu_seqlens_q", "context_lens",
                 "seq_lens", "token_mask"):
        assert torch.equal(getattr(got, name), getattr(batch, name)), name
    assert (got.max_q_len, got.max_seq_len) == (batch.max_q_len, batch.max_seq_len)
