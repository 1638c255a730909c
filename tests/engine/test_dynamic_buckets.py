"""The dynamic modes' padded step shapes (``EngineConfig.dynamic_graph_tokens``): a small prefill
or mixed step runs at the smallest fixed bucket that holds it, as vLLM replays mixed batches
from CUDA graphs captured at padded token counts. On the CPU there are no graphs, so the buckets
are given explicitly and run eagerly (the path a GPU replays; graph replay against eager at the
same shapes is ``tests/engine/test_gpu_engine.py``'s).

Checked: the config resolves and validates the buckets; the bucket chosen for a step is the
smallest that holds it; a bucketed step's buffers hold the real decode tokens, dummy decode
slots, then the chunks; under both batch-invariant modes every request keeps its fingerprint,
logprobs and prompt logprobs with the buckets on and off (dense, MoE and MLA models), while
``default``, whose kernels see the padded shapes, changes them (the negative control: the
padding reaches the kernels).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from corun.config import DYNAMIC_GRAPH_TOKENS, EngineConfig
from corun.engine import LLMEngine
from corun.model_runner import ModelRunner
from corun.outputs import RequestOutput
from corun.sampling_params import SamplingParams
from corun.serve import build_parser, engine_config_kwargs
from corun.step import StepShape, dynamic_buckets, dynamic_decode_counts, smallest_bucket
from tests.engine.conftest import TINY

BUCKETS = (8, 16)


# -- config ----------------------------------------------------------------------------------------


def test_buckets_resolve_by_mode_and_graphs():
    cpu = EngineConfig(mode="default", **TINY)
    assert cpu.dynamic_graph_tokens is None and cpu.dynamic_step_tokens == []  # no graphs here
    assert EngineConfig(mode="default", dynamic_graph_tokens=(16, 8, 16),
                        **TINY).dynamic_step_tokens == [8, 16]
    assert EngineConfig(mode="corun", dynamic_graph_tokens=BUCKETS,
                        **TINY).dynamic_step_tokens == []  # corun's steps are fixed already
    gpu = EngineConfig(mode="batch_invariant", device="cuda", max_num_batched_tokens=1024)
    assert gpu.dynamic_step_tokens == [t for t in DYNAMIC_GRAPH_TOKENS if t <= 1024]
    assert EngineConfig(mode="default", device="cuda", cuda_graphs=False).dynamic_step_tokens == []


@pytest.mark.parametrize("value", [(0,), (8, -1), (True,), "8,16", (8.0,), [None]])
def test_bad_buckets_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="dynamic_graph_tokens: expected None or a tuple"):
        EngineConfig(mode="default", dynamic_graph_tokens=value, **TINY)


def test_buckets_past_the_step_budget_are_refused():
    with pytest.raises(ValueError, match="dynamic_graph_tokens: .* above max_num_batched_tokens"):
        EngineConfig(mode="default", dynamic_graph_tokens=(8, 32), **TINY)


def test_server_flag():
    def parsed(*flags):
        return engine_config_kwargs(build_parser().parse_args(list(flags)))["dynamic_graph_tokens"]

    assert parsed() is None
    assert parsed("--dynamic-graph-tokens", "none") == ()
    assert parsed("--dynamic-graph-tokens", "256,512") == (256, 512)
    for bad in ("0", "a,b", ""):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--dynamic-graph-tokens", bad])


# -- choosing a bucket -----------------------------------------------------------------------------


def test_decode_counts_are_coarse_and_reach_the_fullest_mixed_step():
    assert dynamic_decode_counts(1) == [0]  # one sequence: it is the prefilling one
    assert dynamic_decode_counts(4) == [0, 3]
    assert dynamic_decode_counts(64) == [0, 4, 16, 63]
    assert dynamic_decode_counts(256) == [0, 4, 16, 64, 255]


def test_buckets_cover_each_token_count_and_decode_count():
    shapes = dynamic_buckets([8, 16], [0, 1, 4], prefill_rows=2)
    assert {(s.num_tokens, s.num_decode_tokens) for s in shapes} == {
        (t, nd) for t in (8, 16) for nd in (0, 1, 4)}
    assert all(s.is_fixed and s.is_prefill and s.num_prefill_seqs == 2 for s in shapes)
    assert all(s.max_q_len == s.num_tokens - s.num_decode_tokens for s in shapes)
    assert shapes[0].num_tokens == 16  # largest first: captured first, sizing the graph pool
    assert [s.num_decode_tokens for s in dynamic_buckets([4], [0, 4, 8], 1)] == [0]


def _fits(step: StepShape, bucket: StepShape) -> bool:
    return (bucket.num_decode_tokens >= step.num_decode_tokens
            and bucket.num_tokens - bucket.num_decode_tokens
            >= step.num_tokens - step.num_decode_tokens
            and bucket.num_prefill_seqs >= step.num_prefill_seqs)


@given(decode=st.integers(0, 63), prefill=st.lists(st.integers(1, 600), min_size=1, max_size=6))
def test_smallest_bucket_holds_the_step_and_nothing_smaller_does(decode, prefill):
    buckets = dynamic_buckets(list(DYNAMIC_GRAPH_TOKENS), dynamic_decode_counts(64), 4)
    step = StepShape(True, decode + sum(prefill), decode + len(prefill), decode + len(prefill),
                     max_q_len=max(prefill), num_decode_tokens=decode, is_fixed=False)
    chosen = smallest_bucket(step, buckets)
    fitting = [b for b in buckets if _fits(step, b)]
    if not fitting:
        assert chosen is None
        return
    assert chosen in fitting and chosen.max_q_len >= step.max_q_len
    assert chosen.num_sample_rows >= step.num_sample_rows
    assert all((chosen.num_tokens, chosen.num_seqs) <= (b.num_tokens, b.num_seqs)
               for b in fitting)


# -- running bucketed steps ------------------------------------------------------------------------

# Arrivals one step apart, so later prompts prefill while earlier ones decode (mixed steps).
ARRIVALS = [([30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40], 5, None),
            ([7, 8], 6, 2), ([3, 4, 5, 6, 9], 5, None), (list(range(60, 73)), 4, 1),
            ([11] * 3, 3, None)]


def _run(mode: str, buckets: tuple[int, ...], model: str = "tiny-qwen3",
         shapes: list | None = None) -> dict[str, RequestOutput]:
    engine = LLMEngine(EngineConfig(mode=mode, dynamic_graph_tokens=buckets,
                                    **dict(TINY, model=model)))
    runner = engine.runner
    if shapes is not None:
        launch = runner._launch

        def recording(shape, bufs, host):
            shapes.append((shape, _views(runner, shape, bufs, host)))
            return launch(shape, bufs, host)

        runner._launch = recording
    finals: dict[str, RequestOutput] = {}
    for i, (prompt, max_tokens, prompt_logprobs) in enumerate(ARRIVALS):
        engine.add_request(prompt, SamplingParams(
            max_tokens=max_tokens, temperature=0.8, top_k=50, seed=i, logprobs=2,
            prompt_logprobs=prompt_logprobs), f"r{i}")
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert len(finals) == len(ARRIVALS), "a request was lost"
    return finals


def _views(runner: ModelRunner, shape: StepShape, bufs, host) -> dict | None:
    if not (shape.is_prefill and shape.is_fixed):
        return None
    bound = runner._bind(shape, bufs, host)
    b = bound.batch
    return {"ids": bound.input_ids.clone(), "positions": b.positions.clone(),
            "slots": b.slot_mapping.clone(), "mask": b.token_mask.clone(),
            "seq_lens": None if b.seq_lens is None else b.seq_lens.clone(),
            "cu": b.cu_seqlens_q.clone(), "context_lens": b.context_lens.clone(),
            "sample_rows": bound.sample_rows.clone(), "real_tokens": sum(host.context_lens)}


def test_bucketed_steps_hold_decode_tokens_dummy_slots_then_chunks():
    shapes: list = []
    _run("batch_invariant", BUCKETS, shapes=shapes)
    bucketed = [(s, v) for s, v in shapes if v is not None]
    assert bucketed, "no step ran at a dynamic bucket"
    padded_decode = 0
    for shape, v in bucketed:
        nd = shape.num_decode_tokens
        live = int((v["seq_lens"] > 0).sum()) if nd else 0
        assert v["seq_lens"] is None or v["seq_lens"][live:].eq(0).all()
        # Decode rows: real tokens first, then dummy slots that write and read nothing.
        assert v["mask"][:live].all() and not v["mask"][live:nd].any()
        assert v["slots"][live:nd].eq(-1).all() and v["slots"][:live].ge(0).all()
        padded_decode += nd - live
        # Chunks from row nd on, cu_seqlens counted from there; dummies after the last chunk.
        cu = v["cu"]
        real = int(cu[-1])
        assert cu[0] == 0 and v["mask"][nd:nd + real].all() and not v["mask"][nd + real:].any()
        assert v["slots"][nd + real:].eq(-1).all()
        assert shape.max_q_len == shape.num_tokens - nd
        lengths = (cu[1:] - cu[:-1]).tolist()
        ends = v["context_lens"].tolist()
        for row, (length, end) in enumerate(zip(lengths, ends, strict=True)):
            if length:  # a real chunk: its positions end at its sequence's length
                start = nd + int(cu[row])
                assert v["positions"][start:start + length].tolist() == list(
                    range(end - length, end))
        for row in v["sample_rows"].tolist():
            assert row < live or row == 0 or nd <= row < nd + real
    assert padded_decode, "no bucket padded a step's decode tokens"


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3"])
@pytest.mark.parametrize("mode", ["batch_invariant", "batch_invariant_tuned"])
def test_buckets_keep_the_batch_invariant_bits(mode, model):
    """Every request's tokens, fingerprint, logprobs and prompt logprobs are the same whether
    its mixed steps ran at their exact shapes or padded to a bucket."""
    shapes: list = []
    bucketed = _run(mode, BUCKETS, model, shapes=shapes)
    assert any(v is not None for _, v in shapes), "no step ran at a dynamic bucket"
    exact = _run(mode, (), model)
    for request_id, out in exact.items():
        got = bucketed[request_id]
        assert got.token_ids == out.token_ids and got.fingerprint == out.fingerprint, request_id
        assert got.outputs[0].logprobs == out.outputs[0].logprobs, request_id
        assert got.prompt_logprobs == out.prompt_logprobs, request_id
    assert any(out.prompt_logprobs for out in exact.values())


def test_default_sees_the_padded_shapes_negative_control():
    """``default`` sizes its kernels by the step (on this CPU an fp32 matmul row changes with
    M): the padded steps change some request's fingerprint, so the padding reaches the kernels
    and the equality above is not vacuous."""
    bucketed, exact = _run("default", BUCKETS), _run("default", ())
    assert any(bucketed[r].fingerprint != exact[r].fingerprint for r in exact)


def test_step_records_count_the_padded_tokens():
    engine = LLMEngine(EngineConfig(mode="batch_invariant", dynamic_graph_tokens=BUCKETS, **TINY))
    engine.profile_steps = True
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0), "a")
    while engine.has_unfinished_requests():
        engine.step()
    prefill = [r for r in engine.step_records if r.kind == "prefill"]
    assert prefill and prefill[0].num_real_tokens == 3 and prefill[0].num_tokens == 8


def test_warmup_and_eager_twin_cover_the_buckets():
    config = EngineConfig(mode="default", dynamic_graph_tokens=BUCKETS, **TINY)
    runner = ModelRunner(config)
    assert {b.num_tokens for b in runner.dynamic_buckets} == set(BUCKETS)
    assert set(runner.dynamic_buckets) <= set(runner.fixed_shapes())
    runner.warmup()  # every bucket runs once on padding
    twin = runner.eager_twin()
    assert not twin.cuda_graphs and twin.dynamic_step_tokens == list(BUCKETS)
    assert ModelRunner(twin, model=(runner.model, runner.model_config)).dynamic_buckets \
        == runner.dynamic_buckets
    off = ModelRunner(EngineConfig(mode="default", **TINY), model=(runner.model,
                                                                    runner.model_config))
    assert off.dynamic_buckets == [] and off.eager_twin().dynamic_step_tokens == []
    step = StepShape(True, 5, 2, 2, max_q_len=4, num_decode_tokens=1, is_fixed=False)
    assert runner.step_shape(step) == StepShape.dynamic_bucket(8, 3, 4)  # counts 0, 3
    assert off.step_shape(step) is step
