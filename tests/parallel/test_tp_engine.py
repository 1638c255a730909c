"""The engine at tensor_parallel_size=2 on the CPU (gloo, torch backend, fp32).

Topology under test (``corun.tp_executor``): this process is rank 0 (scheduler, sampler, rank 0's
shard); one spawned worker process is rank 1.

- TP=2 vs TP=1, dense / MoE / MLA: greedy requests give the same token ids, and the log-prob of
  every chosen token (a log-softmax over the full-vocabulary logits row, so it moves with any
  logit) agrees within fp32 tolerance. Fingerprints are not compared across TP sizes: they hash
  the logits' bits, and the row-parallel layers add partial sums in another order at TP=2.
- Under corun at TP=2 a target request's fingerprint is the same alone and beside drawn
  co-runners, arrival orders, admission steps and decode slots, and when it is swapped out and
  back in (every rank swaps its cache shard); under default at TP=2 some of the same scenarios
  change it (the negative control).
- A worker killed mid-run, or one that raises, makes ``generate`` raise ``WorkerError`` within
  seconds naming the rank, and no worker process is left.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from corun import LLM, SamplingParams, StructuredOutput
from corun.config import EngineConfig
from corun.outputs import RequestOutput
from models.parallel import WorkerError

TINY = dict(dtype="float32", device="cpu", backend="torch", max_num_seqs=4, max_model_len=64,
            block_size=4, prefill_chunk_size=8, max_num_batched_tokens=16,
            prefill_step_tokens=16, max_prefill_seqs_per_step=4, prefill_token_budget=16)
# 16 blocks of 4 tokens: one max_model_len sequence, so co-runners of ~30 tokens force swaps.
TIGHT_KV_BLOCKS = 16
MODELS = ("tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-hy3")
# Measured max |logprob TP2 - TP1|: 7.2e-7 dense, 9.5e-7 MoE, 1.7e-6 MLA.
LOGPROB_ATOL = 1e-5
TARGET_PROMPT = [17, 3, 250, 9, 81, 44, 5, 128, 66, 7, 200, 31, 12]  # two prefill chunks of 8
TARGET_PARAMS = SamplingParams(max_tokens=6, temperature=0.8, top_k=40, top_p=0.9, seed=1234)
IN_CI = settings(max_examples=4, derandomize=True, database=None, deadline=None,
                 phases=(Phase.explicit, Phase.generate),
                 suppress_health_check=list(HealthCheck))


def _no_workers_left() -> bool:
    return not [p for p in mp.active_children() if p.name.startswith("corun-tp-rank")]


def _finals(llm: LLM) -> dict[str, RequestOutput]:
    finals = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_config_validates_tensor_parallel_size():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            EngineConfig(tensor_parallel_size=bad)
    assert EngineConfig(device="cpu", tensor_parallel_size=2).distributed_backend == "gloo"


@pytest.mark.parametrize("model", MODELS)
def test_tp2_greedy_matches_tp1(model):
    """Same greedy token ids at TP=2 as at TP=1; chosen-token logprobs within fp32 tolerance."""
    prompts = [TARGET_PROMPT, [5, 6, 7], list(range(30, 50))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    with LLM(model, **TINY) as tp1:
        expected = tp1.generate(prompts, params, use_tqdm=False)
    with LLM(model, tensor_parallel_size=2, **TINY) as tp2:
        got = tp2.generate(prompts, params, use_tqdm=False)
    assert _no_workers_left()
    worst = 0.0
    for e, g in zip(expected, got, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        diff = torch.tensor(g.outputs[0].logprobs) - torch.tensor(e.outputs[0].logprobs)
        worst = max(worst, float(diff.abs().max()))
    print(f"{model}: max |logprob TP2 - TP1| = {worst:.3g}")
    assert worst <= LOGPROB_ATOL


def test_tp2_structured_output_matches_tp1():
    """Structured output at TP=2 (the mask is applied on rank 0, which samples): the outputs
    match their grammar and equal TP=1's."""
    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 4}},
              "required": ["k"]}
    params = [SamplingParams(seed=3, max_tokens=40,
                             structured=StructuredOutput.from_schema(schema)),
              SamplingParams(temperature=0.0, max_tokens=8,
                             structured=StructuredOutput("regex", "[a-f]{3}[0-9]")),
              SamplingParams(seed=4, n=2, max_tokens=6,
                             structured=StructuredOutput.from_choices(["on", "off"]))]
    prompts = ["json: ", "hex: ", "switch: "]
    config = {**TINY, "max_model_len": 128}
    with LLM("corun-default", **config) as tp1:
        expected = tp1.generate(prompts, params, use_tqdm=False)
    with LLM("corun-default", tensor_parallel_size=2, **config) as tp2:
        got = tp2.generate(prompts, params, use_tqdm=False)
    assert _no_workers_left()
    assert [[o.token_ids for o in r.outputs] for r in got] == \
        [[o.token_ids for o in r.outputs] for r in expected]
    json_out, hex_out, switch = got
    assert json_out.outputs[0].finish_reason == "stop"
    assert set(json.loads(json_out.outputs[0].text)) == {"k"}
    assert re.fullmatch("[a-f]{3}[0-9]", hex_out.outputs[0].text)
    assert all(o.text in ("on", "off") for o in switch.outputs)


# -- determinism at TP=2 ---------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    corunners: tuple[tuple[int, int], ...]  # (prompt length, max_tokens) in arrival order
    target_index: int  # co-runners arriving before the target
    admit_step: int  # engine steps run before the target is added
    seed: int


@st.composite
def scenarios(draw) -> Scenario:
    num = draw(st.integers(1, 3))
    corunners = tuple((draw(st.integers(1, 24)), draw(st.integers(1, 8))) for _ in range(num))
    return Scenario(corunners, draw(st.integers(0, num)), draw(st.integers(0, 4)),
                    draw(st.integers(0, 2**32 - 1)))


# The target last behind a 48-token co-runner: both outgrow the 16-block pool and the target,
# the latest arrival, is swapped out and back in.
PREEMPTING = Scenario(((48, 8),), 1, 0, 4)
# The target in slot 2 behind two shorter co-runners that finish first (it moves down).
SLOT_2 = Scenario(((2, 3), (3, 5)), 2, 0, 5)


def run_scenario(llm: LLM, sc: Scenario) -> tuple[RequestOutput, list[int]]:
    """The target's output and the decode slots it sat in."""
    gen = torch.Generator().manual_seed(sc.seed)
    requests = []
    for i, (length, max_tokens) in enumerate(sc.corunners):
        prompt = torch.randint(2, 256, (length,), generator=gen).tolist()
        temperature = [0.0, 1.0][int(torch.randint(0, 2, (1,), generator=gen))]
        seed = int(torch.randint(0, 2**62, (1,), generator=gen))
        requests.append((f"co{i}", prompt, SamplingParams(max_tokens=max_tokens,
                                                          temperature=temperature, seed=seed)))
    requests.insert(sc.target_index, ("target", TARGET_PROMPT, TARGET_PARAMS))
    engine, slots = llm.engine, []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        if out.is_decode:
            slots.extend(i for i, c in enumerate(out.chunks) if c.seq.request_id == "target")
        return out

    engine.scheduler.schedule = recording_schedule
    try:
        finals = {}
        for request_id, prompt, params in requests[: sc.target_index]:
            engine.add_request(prompt, params, request_id)
        for _ in range(sc.admit_step):
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        for request_id, prompt, params in requests[sc.target_index:]:
            engine.add_request(prompt, params, request_id)
        finals.update(_finals(llm))
    finally:
        engine.scheduler.schedule = schedule
    assert set(finals) == {r[0] for r in requests}, "a request was lost"
    return finals["target"], slots


# Function scope: one engine at TP > 1 per process at a time (it owns the default process group).
@pytest.fixture
def corun_tp2():
    # No prefix caching: the target's prompt, cached by the alone run, would let the preempting
    # scenario fit, and the swap on both ranks is what this fixture is for (caching's own hit ==
    # miss tests are in tests/engine/test_prefix_cache.py).
    with LLM("tiny-qwen3", mode="corun", tensor_parallel_size=2, enable_prefix_caching=False,
             num_kv_blocks=TIGHT_KV_BLOCKS, **TINY) as llm:
        llm.engine.add_request(TARGET_PROMPT, TARGET_PARAMS, "target")
        yield llm, _finals(llm)["target"]


@pytest.fixture
def default_tp2():
    with LLM("tiny-qwen3", mode="default", tensor_parallel_size=2, **TINY) as llm:
        llm.engine.add_request(TARGET_PROMPT, TARGET_PARAMS, "target")
        yield llm, _finals(llm)["target"]


def test_corun_tp2_fingerprint_is_independent_of_corunners(corun_tp2):
    """Under corun at TP=2 the target's fingerprint beside co-runners, in any arrival order,
    admission step and slot equals its fingerprint alone."""
    llm, alone = corun_tp2
    seen = {"slots": set(), "preempted": False}

    @IN_CI
    @given(sc=scenarios())
    @example(sc=PREEMPTING)
    @example(sc=SLOT_2)
    def fingerprint_is_independent(sc):
        """The target's fingerprint is its fingerprint alone."""
        got, slots = run_scenario(llm, sc)
        assert got.outputs[0].token_ids == alone.outputs[0].token_ids
        assert got.outputs[0].fingerprint == alone.outputs[0].fingerprint
        seen["slots"].update(slots)
        seen["preempted"] |= got.outputs[0].num_preemptions > 0

    fingerprint_is_independent()
    # The scenarios did move the target across slots and through a swap on both ranks.
    assert len(seen["slots"]) > 1 and seen["preempted"], seen


def test_default_tp2_negative_control(default_tp2):
    """Under default at TP=2 some pinned scenario changes the target's fingerprint, so the
    equality above can fail (CPU fp32 matmul rows differ between M = 1 and M >= 2)."""
    llm, alone = default_tp2
    changed = [sc for sc in (SLOT_2, Scenario(((24, 8), (11, 8), (2, 6)), 1, 3, 3))
               if run_scenario(llm, sc)[0].outputs[0].fingerprint
               != alone.outputs[0].fingerprint]
    assert changed, "default mode matched in every scenario: the invariance check is vacuous"


def _staggered(llm: LLM) -> dict[str, str]:
    """Three requests added one step apart (mixed steps): every request's fingerprint."""
    finals = {}
    for i, prompt in enumerate([TARGET_PROMPT, [5, 6, 7], list(range(30, 41))]):
        llm.engine.add_request(prompt, SamplingParams(max_tokens=5, temperature=0.8, seed=i),
                               f"r{i}")
        finals.update({o.request_id: o.fingerprint for o in llm.engine.step() if o.finished})
    finals.update({r: o.fingerprint for r, o in _finals(llm).items()})
    return finals


def test_tp2_dynamic_buckets_keep_batch_invariant_bits():
    """At TP=2 the workers run the padded bucket rank 0 picked for a mixed step (its header
    carries the shape): batch_invariant fingerprints with the buckets equal those without."""
    prints, padded = {}, 0
    for buckets in ((), (8, 16)):
        with LLM("tiny-qwen3", mode="batch_invariant", tensor_parallel_size=2,
                 dynamic_graph_tokens=buckets, **TINY) as llm:
            llm.engine.profile_steps = True
            prints[buckets] = _staggered(llm)
            padded += sum(r.num_tokens > r.num_real_tokens for r in llm.engine.step_records)
    assert _no_workers_left()
    assert padded, "no step ran at a bucket"
    assert prints[(8, 16)] == prints[()] and len(prints[()]) == 3


# -- failures --------------------------------------------------------------------------------


def _kill(llm: LLM, pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _make_raise(llm: LLM, pid: int) -> None:
    llm.engine.runner.workers.conns[0].send(("no_such_command",))  # the worker raises on it


@pytest.mark.parametrize(("fault", "match"), [
    (_kill, r"rank 1 exited with code -9"),
    (_make_raise, r"rank 1 failed:(.|\n)*unknown tensor-parallel command"),
], ids=["killed", "raises"])
@pytest.mark.timeout(120)  # the property is "raises, not hangs": a hang fails here
def test_failed_worker_makes_generate_raise(fault, match):
    """A worker that dies or raises mid-run makes generate raise WorkerError naming rank 1
    (instead of rank 0 waiting on it forever); no worker process is left, and the engine
    refuses further steps."""
    llm = LLM("tiny-qwen3", tensor_parallel_size=2, **dict(TINY, max_model_len=512))
    pid = llm.engine.runner.workers.pids[0]
    injected = threading.Event()

    def inject() -> None:  # mid-run: after a few steps of a long generation
        while llm.engine.num_steps < 4:
            time.sleep(0.001)
        injected.set()  # before the fault: generate may raise the moment it lands
        fault(llm, pid)

    threading.Thread(target=inject, daemon=True).start()
    with pytest.raises(WorkerError, match=match):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=500, ignore_eos=True),
                     use_tqdm=False)
    assert injected.is_set()  # the failure came from the injected fault, not before it
    assert _no_workers_left()
    with pytest.raises(WorkerError, match="stopped"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.close()


# -- server ----------------------------------------------------------------------------------


def _worker_pids(server_pid: int) -> list[int]:
    """The server's spawned rank processes (its other child is multiprocessing's tracker)."""
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(server_pid)],
                         capture_output=True, text=True, check=False).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "spawn_main" in line]


def test_server_tp2_answers_then_exits_when_a_worker_dies(tmp_path):
    """``corun.serve -tp 2`` answers a greedy completion with the TP=1 engine's text; when its
    worker is killed, the idle server notices (no request needs to arrive) and exits with code 1
    and the reason; the wait's own timeout fails a server that never notices."""
    from corun.default_model import ASSETS_DIR
    from tests.api.conftest import launch

    server = launch(tmp_path, "tp2", "--tensor-parallel-size", "2", "--device", "cpu",
                    "--dtype", "float32", "--max-num-seqs", "2", "--model", "tiny-qwen3")
    try:
        body = {"model": "tiny-qwen3", "prompt": [5, 6, 7, 8], "max_tokens": 4,
                "temperature": 0.0, "ignore_eos": True}
        with server.client() as client:
            response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        # The server serves a named config with the byte-level tokenizer of corun/assets.
        with LLM("tiny-qwen3", tokenizer=ASSETS_DIR,
                 **dict(TINY, max_model_len=128, prefill_chunk_size=64,
                        prefill_step_tokens=64)) as tp1:
            expected = tp1.generate([[5, 6, 7, 8]], SamplingParams(
                max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert response.json()["choices"][0]["text"] == expected[0].outputs[0].text
        workers = _worker_pids(server.proc.pid)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        code = server.proc.wait(timeout=60)
        log = server.log_path.read_text()
        assert code == 1, log[-2000:]
        assert "the engine failed: tensor-parallel rank 1 exited with code -9" in log, log[-2000:]
    finally:
        server.stop()


def test_workers_stop_even_if_rank_0_teardown_raises(monkeypatch):
    """TPModelRunner.destroy stops the workers whatever rank 0's own teardown does."""
    from corun.model_runner import ModelRunner

    llm = LLM("tiny-qwen3", tensor_parallel_size=2, **dict(TINY, max_model_len=512))

    def failing_destroy(self) -> None:
        raise RuntimeError("rank 0 teardown failed")

    monkeypatch.setattr(ModelRunner, "destroy", failing_destroy)
    with pytest.raises(RuntimeError, match="rank 0 teardown failed"):
        llm.close()
    assert _no_workers_left()
