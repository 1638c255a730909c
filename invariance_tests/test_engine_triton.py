"""End-to-end determinism through the served path: the engine with the Triton backend (every op a
``kernels/`` launcher, run by the interpreter on the CPU), on tiny dense, MoE and MLA models.

Property: a target request's fingerprint (its tokens and the bits of the logits behind them) is
the same alone and beside different co-runners, under ``corun`` (packed prefill steps at one fixed
shape, decode at B whatever slot the target gets) and under ``batch_invariant`` (dynamic batching,
chunks cut at the prefill tile). The co-runners arrive first, so the target's chunks sit at
different offsets of shared packed steps, and its decode slot moves.

Negative control: a GEMM policy that picks BLOCK_K from M (the H200 tuned table does: BLOCK_K 256
at decode M, 64 at prefill M; under the interpreter BLOCK_K changes a row's bits) keeps the
target's bits when packed steps are padded to their fixed shape, and changes them when the step's
shape follows its contents (unpadded packing).
"""

from __future__ import annotations

import dataclasses
import os

import pytest

import kernels.gemm as gemm_module
from corun.config import EngineConfig
from corun.engine import LLMEngine
from corun.sampling_params import SamplingParams
from corun.scheduler import CoRunPolicy
from corun.step import StepShape

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the CPU engine on the Triton interpreter; natively on a GPU the same properties are "
           "tests/engine/test_gpu_engine.py's")
MODELS = ["tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3"]
BASE = dict(backend="triton", device="cpu", dtype="float32", max_num_seqs=4, max_model_len=96,
            block_size=8, max_num_batched_tokens=64)
CORUN = dict(BASE, mode="corun", prefill_chunk_size=16, prefill_step_tokens=32,
             max_prefill_seqs_per_step=4, prefill_token_budget=32)
# batch_invariant on the Triton backend: chunks end on the fp32 prefill tile (64 tokens).
BATCH_INVARIANT = dict(BASE, mode="batch_invariant", prefill_chunk_size=64)
TARGET = [17, 3, 250, 9, 81, 44, 5, 128, 66, 7, 200, 31, 12, 9, 9, 1, 2, 3, 4, 5]  # 20 tokens
TARGET_PARAMS = SamplingParams(max_tokens=3, temperature=0.8, top_k=40, top_p=0.9, seed=1234)
CORUNNER_SETS = [
    [],
    [[5] * 7],
    [[6] * 3, [7] * 9, [9] * 2],
]


def _target_fingerprint(config: EngineConfig, corunners: list[list[int]]) -> str:
    engine = LLMEngine(config)
    for i, prompt in enumerate(corunners):
        engine.add_request(prompt, SamplingParams(max_tokens=1 + i, seed=i), f"co{i}")
    engine.add_request(TARGET, TARGET_PARAMS, "target")  # arrives last: later offsets, slots
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert len(finals) == len(corunners) + 1, "a request was lost"
    return finals["target"].fingerprint


def _prints(config: EngineConfig) -> set[str]:
    return {_target_fingerprint(config, corunners) for corunners in CORUNNER_SETS}


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", ["corun", "batch_invariant"])
def test_target_bits_independent_of_corunners_on_the_triton_backend(model, mode):
    """The target's fingerprint is the same alone and beside every co-runner set."""
    config = EngineConfig(model=model, **(CORUN if mode == "corun" else BATCH_INVARIANT))
    assert len(_prints(config)) == 1


def _bk_by_m(m, n, k, dtype, mode, card=None):
    """The H200 table's habit (BLOCK_K by M) on tiny shapes: 16 below 24 rows, else 32."""
    config = gemm_module._gemm_config(gemm_module._tuned_table(card), m, n, k, dtype,
                                      gemm_module.Mode.parse(mode))
    return dataclasses.replace(config, block_k=16 if m < 24 else 32, split_k=1)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-qwen3-moe"])
def test_padded_packing_keeps_bits_under_an_m_dependent_policy(model, monkeypatch):
    """Packed steps padded to T keep the target's bits even when the GEMM config reads M."""
    monkeypatch.setattr(gemm_module, "gemm_config", _bk_by_m)
    assert len(_prints(EngineConfig(model=model, **CORUN))) == 1


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-qwen3-moe"])
def test_unpadded_packing_changes_bits_negative_control(model, monkeypatch):
    """The same policy with steps shaped by their contents: the target's bits change."""
    monkeypatch.setattr(gemm_module, "gemm_config", _bk_by_m)
    schedule = CoRunPolicy._schedule_prefill

    def unpadded(self, sched, out, main, room):
        ok = schedule(self, sched, out, main, room)
        if ok and main:
            out.shape = StepShape.dynamic(out.chunks)
        return ok

    monkeypatch.setattr(CoRunPolicy, "_schedule_prefill", unpadded)
    assert len(_prints(EngineConfig(model=model, **CORUN))) > 1


@pytest.mark.slow
def test_fused_decode_combine_keeps_the_engines_bits():
    """``decode_fused_combine`` is a speed knob only: with 16-token splits (several per decode
    sequence) every request's fingerprint is the same with the combine fused into the split
    launch as with the two launches, and the arrival counts each stream of steps holds (decode,
    prefill) are zeros after."""
    config = EngineConfig(model="tiny-qwen3", decode_split_size=16, **CORUN)
    fused = dataclasses.replace(config, decode_fused_combine=True)
    prints = {}
    for name, cfg in (("two launches", config), ("fused", fused)):
        engine = LLMEngine(cfg)
        for i, prompt in enumerate([TARGET, [5] * 7, [6] * 30]):
            engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.8, seed=i),
                               f"r{i}")
        finals = {}
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o.fingerprint for o in engine.step() if o.finished})
        prints[name] = finals
        for bufs in (engine.runner.decode_buffers, engine.runner.prefill_buffers):
            arrivals = bufs.decode_arrivals
            assert (arrivals is None) == (name == "two launches")
            assert arrivals is None or not arrivals.any()
    assert prints["fused"] == prints["two launches"] and len(prints["fused"]) == 3


def _staggered_prints(config: EngineConfig) -> tuple[dict[str, str], int]:
    """Every request's fingerprint when the target arrives after one step, so its prompt
    prefills beside the co-runners' decode tokens; and how many steps ran padded."""
    engine = LLMEngine(config)
    engine.profile_steps = True
    for i, prompt in enumerate(CORUNNER_SETS[2]):
        engine.add_request(prompt, SamplingParams(max_tokens=2 + i, seed=i), f"co{i}")
    finals = {o.request_id: o.fingerprint for o in engine.step() if o.finished}
    engine.add_request(TARGET, TARGET_PARAMS, "target")
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o.fingerprint for o in engine.step() if o.finished})
    padded = sum(r.num_tokens > r.num_real_tokens for r in engine.step_records
                 if r.kind == "prefill")
    return finals, padded


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_dynamic_buckets_keep_the_bits_on_the_triton_backend(model):
    """batch_invariant's prefill and mixed steps padded to the dynamic buckets (the shapes a GPU
    replays from graphs) give every request the fingerprint of the exact shapes."""
    config = EngineConfig(model=model, **BATCH_INVARIANT)
    exact, unpadded = _staggered_prints(config)
    bucketed, padded = _staggered_prints(dataclasses.replace(config,
                                                             dynamic_graph_tokens=(32, 64)))
    assert unpadded == 0 and padded >= 2, "the steps did not run at the buckets"
    assert bucketed == exact and len(exact) == 4
