"""The engine loop hands each step's outputs to an event loop in one call: its queues get them
in step order, every request all of its outputs."""

from __future__ import annotations

import asyncio

from corun.api import engine_loop as engine_loop_module
from corun.api.engine_loop import EngineLoop
from corun.sampling_params import SamplingParams
from tests.api.inprocess import build_engine


def test_a_steps_outputs_reach_the_event_loop_in_one_call(monkeypatch):
    calls: list[list[str]] = []
    put_all = engine_loop_module._put_all

    def recording(items):
        calls.append([request_id for _, (request_id, _) in items])
        put_all(items)

    monkeypatch.setattr(engine_loop_module, "_put_all", recording)
    engine, _ = build_engine()
    loop = EngineLoop(engine)
    loop.start()
    ids = [f"r{i}" for i in range(4)]

    async def run() -> dict[str, list]:
        queue: asyncio.Queue = asyncio.Queue()
        params = SamplingParams(max_tokens=5, ignore_eos=True, seed=1)
        loop.submit([(i, [5, 6, 7], params) for i in ids], queue)
        got: dict[str, list] = {i: [] for i in ids}
        while not all(got[i] and got[i][-1].finished for i in ids):
            request_id, output = await asyncio.wait_for(queue.get(), 60)
            got[request_id].append(output)
        return got

    try:
        got = asyncio.run(run())
    finally:
        loop.stop()
    for outputs in got.values():  # one a step, none lost, in step order
        assert len(outputs) == 5
        deltas = [t for o in outputs for t in o.outputs[0].delta_token_ids]
        assert deltas == outputs[-1].outputs[0].token_ids
    assert sum(len(c) for c in calls) == 20 and max(len(c) for c in calls) == 4
    assert len(calls) < 20  # one call carries a step's outputs for this loop
