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

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from corun.config import DYNAMIC_GRAPH_TOKENS, EngineConfig
from corun.engine import LLMEngine
from corun.memory_profile import graph_output_bytes
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
    shapes = dynamic_buckets([8, 16], [0, 1, 4], prefill_rows=2, max_chunk=6)
    assert {(s.num_tokens, s.num_decode_tokens) for s in shapes} == {
        (t, nd) for t in (8, 16) for nd in (0, 1, 4)}
    assert all(s.is_fixed and s.is_prefill and s.num_prefill_seqs == 2 for s in shapes)
    # A chunk never outgrows the scheduler's cap: it bounds the prefill attention grid.
    assert all(s.max_q_len == min(s.num_tokens - s.num_decode_tokens, 6) for s in shapes)
    assert shapes[0].num_tokens == 16  # largest first: captured first, sizing the graph pool
    assert [s.num_decode_tokens for s in dynamic_buckets([4], [0, 4, 8], 1, 4)] == [0]


@given(decode=st.integers(0, 63), prefill=st.lists(st.integers(1, 512), min_size=1, max_size=6))
def test_smallest_bucket_is_the_first_token_count_that_holds_the_step(decode, prefill):
    """The bucket equals an independent account: decode tokens round up to the next decode
    count, then the first token count that holds those rows and the prefill tokens; none when
    the step has more chunks than the rows or more tokens than the largest count."""
    counts = dynamic_decode_counts(64)
    buckets = dynamic_buckets(list(DYNAMIC_GRAPH_TOKENS), counts, 4, max_chunk=512)
    step = StepShape(True, decode + sum(prefill), decode + len(prefill), decode + len(prefill),
                     max_q_len=max(prefill), num_decode_tokens=decode, is_fixed=False)
    decode_rows = min(c for c in counts if c >= decode)
    tokens = [t for t in DYNAMIC_GRAPH_TOKENS if t >= decode_rows + sum(prefill)]
    chosen = smallest_bucket(step, buckets)
    if len(prefill) > 4 or not tokens:
        assert chosen is None
    else:
        assert chosen == StepShape.dynamic_bucket(tokens[0], decode_rows, 4, 512)


# -- running bucketed steps ------------------------------------------------------------------------

# Arrivals one step apart, so later prompts prefill while earlier ones decode (mixed steps).
ARRIVALS = [([30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40], 5, None),
            ([7, 8], 6, 2), ([3, 4, 5, 6, 9], 5, None), (list(range(60, 73)), 4, 1),
            ([11] * 3, 3, None)]


def _run(mode: str, buckets: tuple[int, ...], model: str = "tiny-qwen3",
         steps: list | None = None, temperature: float = 0.8) -> dict[str, RequestOutput]:
    """Run ``ARRIVALS`` one step apart; ``steps`` collects (chunks as scheduled, the shape run,
    its filled views) of every prefill step."""
    engine = LLMEngine(EngineConfig(mode=mode, dynamic_graph_tokens=buckets,
                                    **dict(TINY, model=model)))
    runner = engine.runner
    if steps is not None:
        execute = runner.execute

        def recording(part):
            seen = [_Seen(c) for c in part.chunks]  # before the engine commits the step
            result = execute(part)
            shape = runner.step_shape(part.shape)
            if shape.is_prefill:
                host = runner.prefill_buffers.fill(shape, part.chunks)  # the same values again
                steps.append((seen, shape, _views(runner, shape, host)))
            return result

        runner.execute = recording
    finals: dict[str, RequestOutput] = {}
    for i, (prompt, max_tokens, prompt_logprobs) in enumerate(ARRIVALS):
        engine.add_request(prompt, SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_k=50, seed=i, logprobs=2,
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


class _Seen:
    """A chunk as its step saw it."""

    def __init__(self, chunk) -> None:
        self.start, self.end, self.samples = chunk.start, chunk.end, chunk.samples
        self.is_decode = not chunk.seq.is_prefilling
        self.token_ids, self.block_table = list(chunk.seq.token_ids), list(chunk.seq.block_table)


def _views(runner: ModelRunner, shape: StepShape, host) -> dict:
    bound = runner._bind(shape, runner.prefill_buffers, host)
    b = bound.batch
    return {name: getattr(b, name).clone() for name in
            ("positions", "slot_mapping", "token_mask", "block_tables", "cu_seqlens_q",
             "context_lens")} | {
        "ids": bound.input_ids.clone(), "sample_rows": bound.sample_rows.clone(),
        "seq_lens": None if b.seq_lens is None else b.seq_lens.clone()}


def test_bucketed_steps_hold_decode_tokens_dummy_slots_then_chunks():
    """Row by row against the scheduled chunks: the real decode tokens, dummy decode slots up to
    the bucket's count (slot -1, seq_len 0, a zero block row, masked out), the chunks from that
    row on with cu_seqlens counted from it, zero-length padding rows, dummy tokens after; each
    sample row is its chunk's last token, in the chunks' order."""
    steps: list = []
    _run("batch_invariant", BUCKETS, steps=steps)
    bucketed = [(c, s, v) for c, s, v in steps if s.is_fixed]
    assert bucketed, "no step ran at a dynamic bucket"
    padded_decode = 0
    for chunks, shape, v in bucketed:
        nd = shape.num_decode_tokens
        decodes = [c for c in chunks if c.is_decode]
        prefills = [c for c in chunks if not c.is_decode]
        live, real = len(decodes), sum(c.end - c.start for c in prefills)
        padded_decode += nd - live
        for row, chunk in enumerate(decodes):
            assert v["ids"][row] == chunk.token_ids[chunk.start]
            assert v["positions"][row] == chunk.start and v["token_mask"][row]
            assert v["seq_lens"][row] == chunk.end
            assert v["block_tables"][row, :len(chunk.block_table)].tolist() == chunk.block_table
        dummies = slice(live, nd)
        assert v["slot_mapping"][dummies].eq(-1).all() and not v["token_mask"][dummies].any()
        assert v["block_tables"][dummies].eq(0).all()
        assert v["seq_lens"] is None or v["seq_lens"][dummies].eq(0).all()
        cu = v["cu_seqlens_q"]
        assert cu[0] == 0 and cu[len(prefills)] == real and cu[len(prefills):].eq(real).all()
        assert v["context_lens"].tolist() == [c.end for c in prefills] + [0] * (
            shape.num_prefill_seqs - len(prefills))
        row = nd
        for j, chunk in enumerate(prefills):
            span = slice(row, row + chunk.end - chunk.start)
            assert v["ids"][span].tolist() == chunk.token_ids[chunk.start:chunk.end]
            assert v["positions"][span].tolist() == list(range(chunk.start, chunk.end))
            assert v["token_mask"][span].all() and v["slot_mapping"][span].ge(0).all()
            assert v["block_tables"][nd + j, :len(chunk.block_table)].tolist() \
                == chunk.block_table
            row = span.stop
        assert not v["token_mask"][row:].any() and v["slot_mapping"][row:].eq(-1).all()
        last_rows = {id(c): i for i, c in enumerate(decodes)}
        ends, row = {}, nd
        for chunk in prefills:
            row += chunk.end - chunk.start
            ends[id(chunk)] = row - 1
        last_rows |= ends
        expected = [last_rows[id(c)] for c in chunks if c.samples]
        sample_rows = v["sample_rows"].tolist()
        assert sample_rows[:len(expected)] == expected
        assert all(r == 0 for r in sample_rows[len(expected):])
    assert padded_decode, "no bucket padded a step's decode tokens"


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3"])
@pytest.mark.parametrize("mode", ["batch_invariant", "batch_invariant_tuned"])
def test_buckets_keep_the_batch_invariant_bits(mode, model):
    """Every request's tokens, fingerprint, logprobs and prompt logprobs are the same whether
    its mixed steps ran at their exact shapes or padded to a bucket. On the CPU the tuned peer
    runs the portable tiles (its table is the H200's, for 16-bit weights), so its case here is
    the portable one again; its own tiles follow the padded M, which only the GPU test
    (tests/engine/test_gpu_engine.py) checks."""
    steps: list = []
    bucketed = _run(mode, BUCKETS, model, steps=steps)
    assert any(shape.is_fixed for _, shape, _ in steps), "no step ran at a dynamic bucket"
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
    and the equality above is not vacuous; greedy, they still choose the same tokens, so the
    padded step is the same computation up to rounding."""
    bucketed, exact = _run("default", BUCKETS), _run("default", ())
    assert any(bucketed[r].fingerprint != exact[r].fingerprint for r in exact)
    greedy = _run("default", BUCKETS, temperature=0.0), _run("default", (), temperature=0.0)
    assert all(greedy[0][r].token_ids == greedy[1][r].token_ids for r in exact)


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
    assert runner.step_shape(step) == StepShape.dynamic_bucket(8, 3, 4, 8)  # counts 0, 3
    assert off.step_shape(step) is step


def test_buckets_larger_than_a_sequence_run_on_the_triton_backend():
    """A bucket may hold more tokens than one sequence (max_model_len): its chunk length stays
    the scheduler's cap, which the Triton prefill attention accepts (it refuses a max_q_len
    past a block table's span). The interpreter runs every bucket and a request through."""
    config = EngineConfig(**dict(TINY, backend="triton", mode="default", max_model_len=16,
                                 block_size=8, max_num_batched_tokens=32,
                                 dynamic_graph_tokens=(32,)))
    engine = LLMEngine(config)
    buckets = engine.runner.dynamic_buckets
    assert buckets and all(b.max_q_len == config.prefill_chunk_size for b in buckets)
    engine.runner.warmup()
    engine.add_request([5, 6, 7, 8, 9, 10, 11, 12, 13], SamplingParams(max_tokens=3), "a")
    engine.add_request([4, 4], SamplingParams(max_tokens=3), "b")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert sorted(finished) == ["a", "b"]


def test_memory_profile_counts_every_graphs_outputs():
    """Each captured graph keeps its own logits [rows, V] fp32, samples [rows, 3] int64 and
    hidden rows [T, H]: the profile adds them for every graphable shape (a CUDA config; only
    the arithmetic runs here)."""
    runner = ModelRunner(EngineConfig(mode="default", dynamic_graph_tokens=BUCKETS, **TINY))
    assert graph_output_bytes(runner) == 0  # no graphs on the CPU
    runner.config = dataclasses.replace(runner.config, device="cuda")
    hidden, vocab = runner.model_config.hidden_size, runner.vocab_size
    shapes = runner.fixed_shapes()
    assert len(shapes) == len(runner.config.decode_buckets) + len(runner.dynamic_buckets)
    expected = sum(s.num_sample_rows * (vocab * 4 + 24) + s.num_tokens * hidden * 4
                   for s in shapes)
    assert graph_output_bytes(runner) == expected
