"""Shared-prefix workloads for the prefix-cache tests: requests arriving at given engine steps,
run to the end; what a request produced (per sample: token ids, logprobs, fingerprint)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from corun.config import EngineConfig
from corun.engine import LLMEngine
from corun.kv_cache import BlockManager
from corun.prefix_cache import prompt_block_hashes
from corun.sampling_params import SamplingParams
from corun.scheduler import Scheduler

# A sampled sample's result: (token ids, logprobs, fingerprint).
Result = tuple[tuple[int, ...], tuple[float, ...] | None, str]


@dataclass(frozen=True)
class Req:
    request_id: str
    prompt: tuple[int, ...]
    arrival_step: int = 0  # engine steps run before it is added
    max_tokens: int = 4
    n: int = 1
    seed: int = 0

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, n=self.n, temperature=0.8, top_k=40,
                              top_p=0.9, seed=self.seed, logprobs=0, ignore_eos=True)


@dataclass
class Run:
    results: dict[str, list[Result]]
    stats: dict
    num_preemptions: dict[str, int]


def run_workload(config: EngineConfig, requests: list[Req], engine: LLMEngine | None = None,
                 granularity: int | None = None) -> Run:
    """Run ``requests`` (each added once ``arrival_step`` steps have run). ``granularity``
    overrides the prefix cache's reuse unit (the negative controls' unpromised one)."""
    if engine is None:
        engine = LLMEngine(config)
    if granularity is not None:
        engine.scheduler.block_manager.cache_granularity = granularity
    pending = sorted(requests, key=lambda r: r.arrival_step)
    finals, step = {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrival_step <= step:
            req = pending.pop(0)
            engine.add_request(list(req.prompt), req.params, req.request_id)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        step += 1
        assert step < 2000, "the engine made no progress"
    results = {rid: [(tuple(c.token_ids), tuple(c.logprobs) if c.logprobs else None,
                      c.fingerprint) for c in out.outputs] for rid, out in finals.items()}
    preempted = {rid: sum(c.num_preemptions for c in out.outputs) for rid, out in finals.items()}
    return Run(results, engine.stats(), preempted)


def run_each_alone(config: EngineConfig, requests: list[Req]) -> dict[str, list[Result]]:
    """Every request alone on a fresh engine with caching off: the bits it must have."""
    off = dataclasses.replace(config, enable_prefix_caching=False)
    results = {}
    for req in requests:
        results.update(run_workload(off, [dataclasses.replace(req, arrival_step=0)]).results)
    return results


def prompt(seed: int, length: int, vocab: int = 256) -> tuple[int, ...]:
    """A fixed pseudo-random prompt (an LCG: no global RNG)."""
    out, x = [], seed * 7919 + 1
    for _ in range(length):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(x % vocab)
    return tuple(out)


def register_decode_blocks_too(monkeypatch) -> None:
    """Break the prefill-only rule (negative controls): every full block a sequence computed is
    registered after every step, the blocks its decode steps wrote included."""

    def register_everything(self, seq):
        done = seq.num_computed_tokens // self.cache_granularity * self.cache_granularity
        hashes = prompt_block_hashes(seq.token_ids, self.block_size)
        for index in range(seq.num_cached_blocks, done // self.block_size):
            self.allocator.register(seq.block_table[index], hashes[index])
        seq.num_cached_blocks = max(seq.num_cached_blocks, done // self.block_size)

    def commit_all(self, chunks):
        for chunk in chunks:
            chunk.seq.num_computed_tokens = chunk.end
            self.block_manager.register_prefill(chunk.seq)

    monkeypatch.setattr(BlockManager, "register_prefill", register_everything)
    monkeypatch.setattr(Scheduler, "commit_chunks", commit_all)
