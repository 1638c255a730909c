"""corun.step_timing on the CPU: a step's time is the host's clock around it (the forward runs
inside the call), every finished step is reported once, in order. The CUDA path (events, a step
that samples nothing timed to its forward's end) is tests/engine/test_gpu_engine.py's."""

from __future__ import annotations

import time

import torch

from corun.step_timing import StepTimer


def test_cpu_steps_are_reported_once_in_order_with_their_host_time():
    timer = StepTimer(torch.device("cpu"))
    start = timer.start()
    time.sleep(0.02)
    timer.finish(start, "prefill", 100, forward_done=False)
    start = timer.start()
    timer.finish(start, "decode", 3, forward_done=True)
    steps = timer.take_finished()
    assert [(s.kind, s.num_real_tokens) for s in steps] == [("prefill", 100), ("decode", 3)]
    assert steps[0].seconds >= 0.02 > steps[1].seconds
    assert timer.take_finished() == []


def test_the_engine_times_every_step_that_ran_a_forward():
    """A prompt of three chunks (two steps that sample nothing, then one that does) and two
    decode steps: five steps reported, by kind, with the tokens each scheduled."""
    from corun.config import EngineConfig
    from corun.engine import LLMEngine
    from corun.llm import LLM
    from corun.sampling_params import SamplingParams

    offline = LLM(model="tiny-qwen3", device="cpu", backend="torch")
    assert offline.engine.step_timer is None  # timed only for a reader (the server)
    offline.close()
    config = EngineConfig(model="tiny-qwen3", dtype="float32", device="cpu", backend="torch",
                          mode="default", max_num_seqs=2, max_num_batched_tokens=16,
                          max_model_len=64)
    engine = LLMEngine(config, time_steps=True)  # as the server builds it
    engine.add_request(list(range(1, 41)), SamplingParams(max_tokens=3, ignore_eos=True), "r")
    while engine.has_unfinished_requests():
        engine.step()
    steps = engine.step_timer.take_finished()
    engine.close()
    assert [(s.kind, s.num_real_tokens) for s in steps] == [
        ("prefill", 16), ("prefill", 16), ("prefill", 8), ("decode", 1), ("decode", 1)]
    assert all(s.seconds > 0 for s in steps)
