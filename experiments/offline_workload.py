"""The offline benchmarks' workloads and the loop that runs one to completion.

A workload is prompts of seeded random token ids, each request with its own sampling seed, EOS
ignored: every variant of ``bench_offline`` (and the sweeps, ablations and paper runs built on it)
runs the very same requests, and a request's fingerprint can be compared across them.
"""

from __future__ import annotations

import dataclasses
import random
import time

import torch
from tqdm.auto import tqdm

from corun.engine import LLMEngine
from corun.outputs import RequestOutput
from corun.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    params: list[SamplingParams]


def make_workload(num: int, input_len: tuple[int, int], output_len: int, vocab: int,
                  seed: int) -> Workload:
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(num):
        length = rng.randint(*input_len)
        prompts.append([rng.randrange(vocab) for _ in range(length)])
        params.append(SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=1.0,
                                     seed=rng.getrandbits(64)))
    return Workload(prompts, params)


def make_shared_prefix_workload(num: int, num_system: int, system_len: tuple[int, int],
                                question_len: tuple[int, int], output_len: int, n_request: int,
                                vocab: int, seed: int) -> Workload:
    """``num`` requests: system prompt ``i % num_system`` plus a question of its own, in a
    shuffled order; with ``n_request`` > 1 the last one samples a question ``n_request`` times."""
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(rng.randint(*system_len))]
               for _ in range(num_system)]
    prompts, params = [], []
    for i in range(num):
        question = [rng.randrange(vocab) for _ in range(rng.randint(*question_len))]
        prompts.append(systems[i % num_system] + question)
        params.append(SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=1.0,
                                     seed=rng.getrandbits(64)))
    order = list(range(num))
    rng.shuffle(order)
    prompts, params = [prompts[i] for i in order], [params[i] for i in order]
    if n_request > 1:
        prompts.append(systems[0] + [rng.randrange(vocab) for _ in range(question_len[0])])
        params.append(SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=1.0,
                                     seed=rng.getrandbits(64), n=n_request))
    return Workload(prompts, params)


def fingerprints(out: RequestOutput) -> tuple:
    """Every sample's fingerprint (n > 1 requests have several)."""
    return tuple(c.fingerprint for c in out.outputs)


def num_output_tokens(out: RequestOutput) -> int:
    return sum(len(c.token_ids) for c in out.outputs)


def run_workload(engine: LLMEngine, work: Workload, order: list[int],
                 desc: str | None = None) -> tuple[dict, float]:
    """Submit ``order``'s requests at once, run to completion; (index -> output, seconds)."""
    if engine.device_is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    # Final outputs only, as LLM.generate asks (and vLLM's offline LLM), from the fifth session
    # of 2026-12-05 on; the runs before built every request's output (detokenized) every step.
    ids = {engine.add_request(work.prompts[i], work.params[i], f"r{i}", arrival_time=start,
                              final_only=True): i
           for i in order}
    finals: dict[int, RequestOutput] = {}
    bar = tqdm(total=len(order), desc=desc, unit="req", disable=desc is None, leave=False)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[ids[out.request_id]] = out
                bar.update(1)
    bar.close()
    return finals, time.perf_counter() - start
