"""LLM.generate that fails part-way leaves nothing behind in its engine.

A call can fail after some of its requests were queued: ``add_request`` refuses one (the queue is
full, or one request has more samples than ``max_queue_len``), or a step raises (a worker error, a
KeyboardInterrupt). The requests it had queued used to stay in the engine: they held the queue
(the next call was refused as "queue full" with nothing of its own in it), and the next call ran
them to the end for nobody. vLLM's LLM aborts the requests it added when adding fails; corun's
aborts every request of the failed call.
"""

from __future__ import annotations

import pytest

from corun import LLM, SamplingParams
from corun.engine import QueueFullError
from tests.engine.conftest import TINY

CONFIG = {k: v for k, v in TINY.items() if k != "model"}


def _assert_clean(llm: LLM) -> None:
    scheduler = llm.engine.scheduler
    assert not scheduler.has_unfinished(), "the failed call left requests queued"
    assert llm.engine.stats()["num_kv_blocks_used"] == 0


def _fresh_fingerprints(prompts, params) -> list[str]:
    with LLM(mode="corun", skip_tokenizer_init=True, **CONFIG) as llm:
        return [o.fingerprint for o in llm.generate(prompts, params, use_tqdm=False)]


def test_a_full_queue_part_way_through_queues_nothing():
    with LLM(mode="corun", skip_tokenizer_init=True, max_queue_len=2, **CONFIG) as llm:
        with pytest.raises(QueueFullError):
            llm.generate([[1], [2], [3]], SamplingParams(max_tokens=2, seed=0), use_tqdm=False)
        _assert_clean(llm)
        # The queue is free again: a call that fits runs, with the bits of a fresh engine.
        params = SamplingParams(max_tokens=3, seed=4)
        outs = llm.generate([[5, 6], [7]], params, use_tqdm=False)
        assert [o.fingerprint for o in outs] == _fresh_fingerprints([[5, 6], [7]], params)
        _assert_clean(llm)


def test_a_request_with_more_samples_than_the_queue_queues_nothing():
    with LLM(mode="corun", skip_tokenizer_init=True, max_queue_len=2, **CONFIG) as llm:
        with pytest.raises(ValueError, match="^n: 3 sequences"):
            llm.generate([[1], [2]], [SamplingParams(max_tokens=2), SamplingParams(n=3)],
                         use_tqdm=False)
        _assert_clean(llm)


def test_a_step_that_raises_leaves_no_request_behind(monkeypatch):
    with LLM(mode="corun", skip_tokenizer_init=True, **CONFIG) as llm:
        engine = llm.engine
        real_step = engine.step
        calls, held = [], []

        def interrupted_step():
            calls.append(None)
            if len(calls) == 3:  # mid-call: the requests are prefilled, none has finished
                held.extend(engine.scheduler.running)
                raise KeyboardInterrupt
            return real_step()

        monkeypatch.setattr(engine, "step", interrupted_step)
        params = SamplingParams(max_tokens=8, seed=2, ignore_eos=True)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[1, 2, 3], [4, 5]], params, use_tqdm=False)
        assert held, "the interrupt came too late to hold a request"
        monkeypatch.setattr(engine, "step", real_step)
        _assert_clean(llm)
        outs = llm.generate([[9, 9]], params, use_tqdm=False)
        assert len(outs) == 1 and outs[0].fingerprint == _fresh_fingerprints([[9, 9]], params)[0]
        assert not engine.has_unfinished_requests()
