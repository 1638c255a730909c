"""The engine's GPU-only properties (skipped on the CPU, with the reason), run on the device.

- Graph replay gives the eager bits: every request's fingerprint is the same with CUDA graphs on
  and off (at the same step shapes), for every fixed shape of corun (packed and isolated
  prefill, decode at B) and every decode bucket of the dynamic modes (the workload's live count
  walks down through them all); the dynamic modes' small mixed steps replay their padded
  buckets, and the batch-invariant modes keep the bits of the unpadded eager steps.
- Packed prefill keeps a request's bits at real shapes: a target prompt's first-token fingerprint
  is the same beside five different sets of co-runners in packed steps, for the Qwen3-8B and the
  Qwen3-30B-A3B layer shapes (depth-truncated: the per-layer shapes are the real ones); the
  negative control packs without padding (the step's shape follows its contents) and under the
  H200 GEMM policy that changes the target's bits.
- ``batch_invariant_tuned`` is batch-invariant at real shapes across M: a row of the GEMM, and a
  token of the MoE layer, has the same bits at every batch size from 1 to 8192 (its tiles change
  with M, split-K never happens); ``corun`` (split-K at small M) is the negative control.
- The penalties' dense per-sequence state keeps the bits of the sparse whole-list form on CUDA.
- The decode batch size: under the shipped policy a corun row decoded at B = 8 and B = 64 has
  other bits (split-K follows M); with one GEMM config across the sizes it should not.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from corun.config import EngineConfig
from corun.engine import LLMEngine
from corun.model_runner import ModelRunner
from corun.sampling_params import SamplingParams
from corun.scheduler import CoRunPolicy
from corun.step import StepShape
from kernels import gemm as gemm_module
from kernels.gemm import TunedTable
from kernels.mode import Mode
from models import create_model
from models.config import NAMED_CONFIGS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="CUDA graphs, bf16 Triton kernels and real shapes need a GPU"),
]
# An explicit pool: sizing from free memory would count what the other tests' models still hold.
GPU = dict(device="cuda", dtype="bfloat16", block_size=16, max_model_len=512, num_kv_blocks=2048)


def _model(name: str, num_layers: int):
    from models.weights import init_random_weights

    config = NAMED_CONFIGS[name].with_layers(num_layers)
    model = create_model(config, dtype=torch.bfloat16, device="cuda")
    init_random_weights(model, config.num_hidden_layers, 0)
    model.process_weights_after_loading()
    return model, config


def _fingerprints(runner: ModelRunner, config: EngineConfig, requests) -> dict[str, str]:
    engine = LLMEngine(config, model_runner=runner)
    for request_id, prompt, params in requests:
        engine.add_request(prompt, params, request_id)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.fingerprint
    return finals


def _walking_workload(num: int) -> list:
    """``num`` requests of mixed lengths whose outputs end one after another, so the decode live
    count passes every bucket below ``num``."""
    gen = torch.Generator().manual_seed(0)
    return [(f"r{i}", torch.randint(1, 1000, (int(torch.randint(3, 200, (1,), generator=gen)),),
                                    generator=gen).tolist(),
             SamplingParams(max_tokens=2 + 3 * i, temperature=1.0, seed=i)) for i in range(num)]


@pytest.mark.parametrize("variant", [
    dict(mode="corun"), dict(mode="corun", prefill_policy="isolated"),
    dict(mode="corun", overlap_prefill_decode=True),
    dict(mode="batch_invariant"), dict(mode="batch_invariant_tuned"), dict(mode="default"),
], ids=["corun", "corun_isolated", "corun_overlap", "bi", "bi_tuned", "default"])
def test_graph_replay_matches_eager_at_every_shape(variant):
    model = _model("qwen3-0.6b", 4)
    base = dict(GPU, model="qwen3-0.6b", max_num_seqs=16, max_num_batched_tokens=512,
                prefill_chunk_size=128, prefill_step_tokens=256, max_prefill_seqs_per_step=8,
                prefill_token_budget=256, **variant)
    requests = _walking_workload(16)
    results, replayed = {}, set()
    config = EngineConfig(cuda_graphs=True, **base)
    runner = ModelRunner(config, model=model)
    replay = runner.graph_runner.replay

    def counting(key):
        replayed.add(key)
        return replay(key)

    runner.graph_runner.replay = counting
    results[True] = _fingerprints(runner, config, requests)
    graphed = {s for s in runner.fixed_shapes() if runner.graphable(s)}
    # Eager at the same step shapes (the dynamic modes' padded buckets included).
    eager = runner.eager_twin()
    runner.destroy()
    runner = ModelRunner(eager, model=model)
    results[False] = _fingerprints(runner, eager, requests)
    runner.destroy()
    assert results[True] == results[False]
    missing = {s for s in graphed if s not in replayed and not s.is_prefill}
    assert not missing, f"decode shapes never replayed: {missing}"
    if base["mode"] == "corun":
        assert any(s.is_prefill for s in replayed), "no prefill step replayed from a graph"


def _staggered_fingerprints(runner: ModelRunner, config: EngineConfig,
                            requests) -> dict[str, str]:
    """One request added per step, so each prompt prefills while the earlier ones decode."""
    engine = LLMEngine(config, model_runner=runner)
    finals = {}
    for request_id, prompt, params in requests:
        engine.add_request(prompt, params, request_id)
        finals.update({o.request_id: o.fingerprint for o in engine.step() if o.finished})
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o.fingerprint for o in engine.step() if o.finished})
    return finals


@pytest.mark.parametrize("mode", ["batch_invariant", "batch_invariant_tuned", "default"])
def test_dynamic_modes_replay_mixed_steps_from_their_buckets(mode):
    """Prompts arriving while others decode make small mixed steps: under graphs they replay a
    dynamic bucket, with the bits of the same padded shapes run eagerly; the batch-invariant
    modes also keep the bits of the exact (unpadded) eager shapes."""
    model = _model("qwen3-0.6b", 4)
    base = dict(GPU, model="qwen3-0.6b", max_num_seqs=16, max_num_batched_tokens=512,
                prefill_chunk_size=128, mode=mode)
    requests = _walking_workload(10)
    config = EngineConfig(cuda_graphs=True, **base)
    runner = ModelRunner(config, model=model)
    buckets = set(runner.dynamic_buckets)
    assert buckets, "no dynamic bucket on a GPU with graphs"
    replayed = set()
    replay = runner.graph_runner.replay

    def counting(key):
        replayed.add(key)
        return replay(key)

    runner.graph_runner.replay = counting
    graphs = _staggered_fingerprints(runner, config, requests)
    eager = runner.eager_twin()
    runner.destroy()
    assert replayed & buckets, "no mixed step replayed from a dynamic bucket"
    runner = ModelRunner(eager, model=model)
    assert _staggered_fingerprints(runner, eager, requests) == graphs
    runner.destroy()
    if mode != "default":
        exact = dataclasses.replace(config, cuda_graphs=False, dynamic_graph_tokens=())
        runner = ModelRunner(exact, model=model)
        assert _staggered_fingerprints(runner, exact, requests) == graphs
        runner.destroy()


def _target_first_token(runner: ModelRunner, config: EngineConfig, corunners) -> str:
    # A short prompt: unpadded, its step's M would range from 24 (alone; the literal policy
    # splits K there, kernels.gemm.auto_split_k) to hundreds (beside co-runners, no split-K).
    target = ("target", list(range(100, 124)), SamplingParams(max_tokens=1, seed=7))
    return _fingerprints(runner, config, [*corunners, target])["target"]


def _corunner_sets(seed: int = 0) -> list[list]:
    gen = torch.Generator().manual_seed(seed)
    sets = [[]]
    for size in (1, 2, 3, 4):
        sets.append([(f"c{size}-{j}", torch.randint(1, 1000, (int(torch.randint(
            5, 400, (1,), generator=gen)),), generator=gen).tolist(),
            SamplingParams(max_tokens=1, seed=j)) for j in range(size)])
    return sets


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-30b-a3b"])
def test_packed_prefill_keeps_bits_at_real_shapes(name, monkeypatch):
    model = _model(name, 4)
    config = EngineConfig(model=name, mode="corun", max_num_seqs=8, prefill_chunk_size=512,
                          prefill_step_tokens=1024, max_prefill_seqs_per_step=8,
                          cuda_graphs=True, **dict(GPU, max_model_len=1536))
    runner = ModelRunner(config, model=model)
    packed = {_target_first_token(runner, config, s) for s in _corunner_sets()}
    assert len(packed) == 1, f"{len(packed)} different fingerprints across co-runner sets"

    # Negative control: the step's shape follows its contents (no padding), under the literal
    # GEMM policy (an empty table: kernels.gemm._fallback_config with auto_split_k), which splits
    # K at the target's M alone and not beside co-runners. A card's tuned table need not split
    # at these M (the H100's table of 2026-12-06 splits none of Qwen3-8B's GEMMs at its M 32-256
    # points, and on it this control kept the bits): the control would then prove nothing.
    monkeypatch.setattr(gemm_module, "_tuned_table", lambda card=None: TunedTable(entries={}))
    schedule = CoRunPolicy._schedule_prefill

    def unpadded(self, sched, out, main, room):
        ok = schedule(self, sched, out, main, room)
        if ok and main:
            out.shape = StepShape.dynamic(out.chunks)
        return ok

    monkeypatch.setattr(CoRunPolicy, "_schedule_prefill", unpadded)
    eager = dataclasses.replace(config, cuda_graphs=False)
    runner.destroy()
    runner = ModelRunner(eager, model=model)
    unpadded_prints = {_target_first_token(runner, eager, s) for s in _corunner_sets()}
    runner.destroy()
    assert len(unpadded_prints) > 1, "unpadded packing kept the bits: the check is vacuous"


def _real_gemm_shapes() -> list[tuple[int, int]]:
    """(N, K) of every GEMM of Qwen3-8B, Qwen3-30B-A3B and DeepSeek-V3 (LM heads included): the
    shapes the tuned table covers and the kernels benchmark times."""
    from experiments.gemm_shapes import BENCH_MODELS, gemm_shapes

    return [(n, k) for _, n, k in gemm_shapes(BENCH_MODELS)]


M_VALUES = (1, 8, 32, 64, 128, 256, 512, 2048, 8192)


@pytest.mark.parametrize("n, k", _real_gemm_shapes())
def test_batch_invariant_tuned_gemm_rows_equal_across_m(n, k):
    from kernels.gemm import gemm

    gen = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k**0.5
    x = torch.randn(max(M_VALUES), k, device="cuda", dtype=torch.bfloat16, generator=gen)
    rows = {m: gemm(x[:m], w, mode=Mode.BATCH_INVARIANT_TUNED)[:1] for m in M_VALUES}
    assert all(torch.equal(rows[m], rows[1]) for m in M_VALUES), \
        [m for m in M_VALUES if not torch.equal(rows[m], rows[1])]


def test_corun_gemm_rows_change_across_m_negative_control():
    """corun may split K at small M: some real shape changes a row's bits across M."""
    from kernels.gemm import gemm

    changed = 0
    for n, k in _real_gemm_shapes():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        x = torch.randn(512, k, device="cuda", dtype=torch.bfloat16)
        ref = gemm(x[:512], w, mode=Mode.CORUN)[:1]
        changed += any(not torch.equal(gemm(x[:m], w, mode=Mode.CORUN)[:1], ref)
                       for m in (1, 8, 32, 64))
    assert changed, "corun never changed a row across M: the invariance check is vacuous"


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_batch_invariant_tuned_moe_tokens_equal_across_t(name):
    from kernels.moe import fused_moe, softmax_topk

    c = NAMED_CONFIGS[name]
    e, h, inter, top_k = c.num_experts, c.hidden_size, c.moe_intermediate_size, \
        c.num_experts_per_tok
    gen = torch.Generator(device="cuda").manual_seed(1)
    w13 = torch.randn(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16, generator=gen) / h**.5
    w2 = torch.randn(e, h, inter, device="cuda", dtype=torch.bfloat16, generator=gen) / inter**.5
    x = torch.randn(2048, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(2048, e, device="cuda", dtype=torch.float32, generator=gen)
    weights, ids = softmax_topk(logits, top_k, True)
    outs = {t: fused_moe(x[:t], w13, w2, weights[:t], ids[:t],
                         mode=Mode.BATCH_INVARIANT_TUNED)[:1]
            for t in (1, 8, 32, 64, 128, 256, 512, 2048)}
    assert all(torch.equal(o, outs[1]) for o in outs.values())


def test_batched_processing_keeps_the_bits_of_one_row_alone_on_cuda():
    """Logits processing on every row at once, against the pool's dense incremental penalty
    state (corun.logits_processing), gives each row the bits of that row processed by itself
    from its whole token lists, on CUDA too at Qwen3's vocabulary (where ``tensor / float``
    multiplies by the float's reciprocal: a row group shares the one Python scalar)."""
    from tests.engine.test_logits_processing import check_batched_processing

    for seed in range(4):
        # 70 rows: two blocks of corun.logits_processing.BLOCK_BYTES (55 rows at this vocabulary)
        check_batched_processing(seed, device="cuda", vocab=151936, num_rows=70, steps=6)


def test_the_memory_profile_counts_logits_processing():
    """What the runner's memory profile adds for logits processing
    (corun.logits_processing.profile_peak_bytes) holds at least a penalty pool of max_num_seqs
    rows at the vocabulary (every engine built in this file runs the profile too)."""
    from corun.logits_processing import profile_peak_bytes
    from corun.sampler import Sampler

    rows, vocab = 64, 151936
    sampler = Sampler("triton", torch.device("cuda"))
    assert profile_peak_bytes(sampler, vocab, rows, torch.device("cuda")) >= rows * vocab * 5


def test_cuda_peak_bytes_counts_the_run_and_not_what_was_there_before():
    """corun.memory_plan.cuda_peak_bytes (both memory-profile measurements use it): a 64 MiB
    temporary counts while a 256 MiB tensor allocated before the run does not."""
    from corun.memory_plan import cuda_peak_bytes

    device = torch.device("cuda")
    held = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    # (fill_, not a sum: summing uint8 on CUDA first widens the tensor to int64, 8x its bytes,
    # which made this test fail on an H100: experiments/results/native-tests-h100.json)
    peak = cuda_peak_bytes(
        lambda: torch.empty(64 << 20, dtype=torch.uint8, device=device).fill_(1), device)
    assert 64 << 20 <= peak < 128 << 20
    del held


def test_step_timer_times_a_step_that_samples_nothing_to_its_forward_s_end():
    """corun.step_timing on CUDA: a step whose forward is still queued when it returns (it
    sampled nothing) is timed to the forward's end and reported once that end has passed, in
    step order; a step that sampled is reported at once."""
    from corun.step_timing import StepTimer

    device = torch.device("cuda")
    timer = StepTimer(device)
    torch.cuda.synchronize(device)
    start = timer.start()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of device time, queued
    timer.finish(start, "prefill", 256, forward_done=False)
    queued = timer.take_finished()
    assert queued == []  # the sleep has not ended: the host did not wait for it
    start = timer.start()
    torch.cuda._sleep(1_000_000)
    timer.finish(start, "decode", 4, forward_done=True)  # as after reading sampled tokens
    steps = timer.take_finished()
    assert [(s.kind, s.num_real_tokens) for s in steps] == [("prefill", 256), ("decode", 4)]
    assert steps[0].seconds > 0.1 > steps[1].seconds  # the sleep counts in its own step
    start = timer.start()
    torch.cuda._sleep(1_000_000_000)
    timer.finish(start, "prefill", 128, forward_done=False)
    assert [s.num_real_tokens for s in timer.take_finished(wait=True)] == [128]  # before idling


def test_the_engine_reports_each_step_once_its_sampling_step_has_read_tokens():
    """LLMEngine(time_steps=True) on CUDA: a prompt of three chunks (two steps that sample
    nothing, whose forwards the host does not wait for) is reported whole right after the step
    that samples, and the decode steps one by one."""
    from corun.config import EngineConfig
    from corun.engine import LLMEngine
    from corun.sampling_params import SamplingParams

    config = EngineConfig(**{**GPU, "max_model_len": 64}, model="tiny-qwen3", mode="default",
                          max_num_seqs=2, max_num_batched_tokens=16, cuda_graphs=False)
    engine = LLMEngine(config, time_steps=True)
    engine.add_request(list(range(1, 41)), SamplingParams(max_tokens=3, ignore_eos=True), "r")
    reported = []
    while engine.has_unfinished_requests():
        engine.step()
        reported.append([(s.kind, s.num_real_tokens) for s in engine.step_timer.take_finished()])
    engine.close()
    # the chunk steps may or may not have ended when the host looks, but the step that samples
    # reports every step up to itself at once
    assert [step for steps in reported for step in steps] == [
        ("prefill", 16), ("prefill", 16), ("prefill", 8), ("decode", 1), ("decode", 1)]
    assert reported[2][-1] == ("prefill", 8) and reported[3] == [("decode", 1)]


def _decode_size_fingerprints(sizes: tuple[int, ...]) -> list[dict[str, str]]:
    """The same requests decoded by corun at each fixed decode batch size, Qwen3-0.6B's shapes
    (4 layers, bf16), each size from its own graphs."""
    model = _model("qwen3-0.6b", 4)
    requests = _walking_workload(8)
    prints = []
    for size in sizes:
        config = EngineConfig(**GPU, model="qwen3-0.6b", mode="corun", max_num_seqs=size,
                              decode_batch_size=size, prefill_chunk_size=128,
                              prefill_step_tokens=256, max_prefill_seqs_per_step=8,
                              prefill_token_budget=256)
        runner = ModelRunner(config, model=model)
        prints.append(_fingerprints(runner, config, requests))
        runner.destroy()  # its KV cache and graphs, before the next size's
    assert all(len(p) == len(requests) for p in prints)
    return prints


def test_corun_rows_change_with_the_decode_batch_size_where_split_k_follows_m_on_gpu():
    """The shipped corun GEMM policy splits K at small M (Qwen3-0.6B's down projection, K 3072:
    4 splits at M 8, none at M 64), so a row decoded at B = 8 and at B = 64 has other bits
    (measured on an H100 on 2026-12-05: experiments/results/native-tests-h100.json lists the
    earlier test that asserted the opposite among the failures). corun never mixes decode sizes,
    so its guarantee holds; capturing several decode sizes would need one GEMM reduction order
    across them (the test below)."""
    from kernels.gemm import gemm_config
    from kernels.utils import device_card

    card = device_card(torch.device("cuda"))  # the table gemm reads on this card
    small, large = (gemm_config(m, 1024, 3072, torch.bfloat16, Mode.CORUN, card=card)
                    for m in (8, 64))
    assert small.split_k != large.split_k  # the cause, as the policy stands
    prints = _decode_size_fingerprints((8, 64))
    assert prints[0] != prints[1]


def test_corun_rows_keep_their_bits_across_decode_sizes_sharing_one_gemm_config_on_gpu(
        monkeypatch):
    """With every GEMM at M <= 64 running the M 64 config (its tile, BLOCK_K and split-K), B = 8
    and B = 64 should keep every fingerprint: whatever else the decode size changes (attention's
    lanes, the graphs, the sampler's rows) must leave a row's bits alone for a multi-size corun
    decode to be deterministic. Whether the tile and BLOCK_K may differ across the sizes (DESIGN.md
    measured BLOCK_K keeping a row's bits on the H200) is a separate question. It passed on an
    H100 (experiments/results/native-tests-h100.json)."""
    import kernels.gemm as gemm_module

    shipped = gemm_module.gemm_config

    def one_config(m, n, k, dtype, mode=Mode.CORUN, card=None):
        return shipped(max(m, 64), n, k, dtype, mode, card=card)

    monkeypatch.setattr(gemm_module, "gemm_config", one_config)
    prints = _decode_size_fingerprints((8, 64))
    assert prints[0] == prints[1]
