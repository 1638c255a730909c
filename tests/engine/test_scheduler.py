"""Scheduler policies without a model: corun's isolated aligned prefill and fixed B, the dynamic
token budget and buckets, the stall bound, and preemption by swapping that never recomputes."""

from __future__ import annotations

import random

import pytest

from corun.config import EngineConfig
from corun.sampling_params import SamplingParams
from corun.scheduler import Scheduler, SchedulerOutput
from corun.sequence import Sequence, SequenceStatus


def _config(mode: str, **kw) -> EngineConfig:
    base = dict(model="tiny-qwen3", mode=mode, device="cpu", max_num_seqs=4, max_model_len=64,
                block_size=4, prefill_chunk_size=8, max_num_batched_tokens=16,
                prefill_step_tokens=16, max_prefill_seqs_per_step=4, prefill_token_budget=16)
    base.update(kw)
    return EngineConfig(**base)


class Sim:
    """Drives a Scheduler like the engine does, appending a fake token for every sampled row."""

    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        self.sched = Scheduler(config, num_blocks)
        self.next_id = 0
        self.steps: list[SchedulerOutput] = []
        self.computed: dict[int, list[int]] = {}  # seq id -> positions run, in order
        self.swapped_out: set[int] = set()

    def add(self, prompt_len: int, max_tokens: int) -> Sequence:
        # A prompt of its own per sequence: shared prompts would hit the prefix cache and skip
        # positions (tests/engine/test_prefix_cache.py covers that).
        seq = Sequence(self.next_id, f"r{self.next_id}", 0, [self.next_id + 1] * prompt_len,
                       SamplingParams(max_tokens=max_tokens), seed=1)
        self.next_id += 1
        self.sched.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        for seq, blocks in out.swap_out:
            assert len(blocks) == self.sched.block_manager.blocks_for(seq.num_computed_tokens)
            self.swapped_out.add(seq.seq_id)
        for seq in out.swap_in:
            assert seq.seq_id in self.swapped_out
            self.swapped_out.discard(seq.seq_id)
        for chunk in out.chunks:
            self.computed.setdefault(chunk.seq.seq_id, []).extend(range(chunk.start, chunk.end))
            assert len(chunk.seq.block_table) * 4 >= chunk.end  # every token has a slot
        samplers = [c.seq for c in out.chunks if c.samples]
        self.sched.commit(out)
        for seq in samplers:
            seq.append_token(2)
            if seq.num_output_tokens == seq.params.max_tokens:
                self.sched.finish(seq)
        self.steps.append(out)
        return out

    def run(self, max_steps: int = 500) -> None:
        while self.sched.has_unfinished():
            self.step()
            assert len(self.steps) < max_steps, "scheduler made no progress"


def test_corun_prefill_is_isolated_aligned_and_decode_is_fixed_b():
    sim = Sim(_config("corun", decode_batch_size=3, max_num_seqs=3, prefill_policy="isolated"),
              num_blocks=64)
    lengths = [5, 19, 8, 1, 17]
    for n in lengths:
        sim.add(n, max_tokens=3)
    sim.run()
    for out in sim.steps:
        if out.is_decode:
            assert out.num_decode_slots == 3 and 1 <= len(out.chunks) <= 3
        else:
            (chunk,) = out.chunks  # one sequence per prefill step
            assert chunk.start % 8 == 0
            assert chunk.end % 8 == 0 or chunk.end == chunk.seq.num_prompt_tokens
            # padded to its bucket: a function of the chunk's own length
            assert out.shape.num_tokens == min(b for b in (16, 8) if b >= chunk.num_tokens) \
                or out.shape.num_tokens == 8
            assert out.shape.num_tokens >= chunk.num_tokens and out.shape.num_seqs == 1
    for seq_id, n in enumerate(lengths):  # every position computed exactly once, in order
        assert sim.computed[seq_id] == list(range(n + 2))


def test_corun_packed_steps_have_one_fixed_shape_and_whole_aligned_chunks():
    """Packed prefill: every prefill step has the shape (T=16 tokens, R=4 rows), holds whole
    chunks ending at multiples of C=8 (or the prompt's end), and never more than T tokens."""
    sim = Sim(_config("corun", decode_batch_size=4, max_num_seqs=4), num_blocks=64)
    lengths = [5, 19, 3, 1, 17, 9, 2]
    for n in lengths:
        sim.add(n, max_tokens=3)
    sim.run()
    prefill_steps = [out for out in sim.steps if not out.is_decode]
    assert any(len(out.chunks) > 1 for out in prefill_steps), "nothing was packed"
    for out in prefill_steps:
        assert (out.shape.num_tokens, out.shape.num_seqs, out.shape.max_q_len) == (16, 4, 8)
        assert out.num_tokens <= 16 and len(out.chunks) <= 4
        for chunk in out.chunks:
            assert chunk.start % 8 == 0
            assert chunk.end % 8 == 0 or chunk.end == chunk.seq.num_prompt_tokens
    for seq_id, n in enumerate(lengths):
        assert sim.computed[seq_id] == list(range(n + 2))


@pytest.mark.parametrize("policy", ["packed", "isolated"])
def test_corun_chunks_of_a_request_do_not_depend_on_corunners(policy):
    def target_chunks(corunner_lengths: list[int]) -> list[tuple[int, int]]:
        sim = Sim(_config("corun", prefill_policy=policy), num_blocks=64)
        for n in corunner_lengths:
            sim.add(n, max_tokens=4)
        target = sim.add(21, max_tokens=2)
        sim.run()
        return [(c.start, c.num_tokens) for out in sim.steps if not out.is_decode
                for c in out.chunks if c.seq is target]

    alone = target_chunks([])
    assert alone == [(0, 8), (8, 8), (16, 5)]
    assert target_chunks([3, 30, 9]) == alone


@pytest.mark.parametrize("policy", ["packed", "isolated"])
@pytest.mark.parametrize("budget", [8, 16, 40])
def test_corun_stall_bound(budget, policy):
    """While sequences decode, the prefill steps between two decode steps add up to at most the
    token budget (padded sizes), or are a single step when one alone exceeds it."""
    sim = Sim(_config("corun", prefill_token_budget=budget, prefill_policy=policy),
              num_blocks=64)
    sim.add(3, max_tokens=12)
    for n in (30, 25, 17):
        sim.add(n, max_tokens=2)
    run, steps, reached = 0, 0, False
    while sim.sched.has_unfinished():
        decoding = any(not s.is_prefilling for s in sim.sched.running)
        out = sim.step()
        if out.is_decode:
            run, steps = 0, 0
            continue
        run, steps = run + out.shape.num_tokens, steps + 1
        if decoding:
            assert run <= budget or steps == 1
            reached |= run + out.shape.num_tokens > budget
    assert reached or budget >= 40, "the budget never bound"


def test_dynamic_budget_mixing_and_buckets():
    config = _config("default", max_num_seqs=5, max_num_batched_tokens=12)
    assert config.decode_buckets == [1, 2, 4, 5]
    sim = Sim(config, num_blocks=64)
    for n in (20, 3, 6, 2, 9):
        sim.add(n, max_tokens=4)
    sim.run()
    mixed = [out for out in sim.steps if not out.is_decode and len(out.chunks) > 1]
    assert mixed, "prefill chunks and other work never shared a step"
    for out in sim.steps:
        assert out.num_tokens <= 12
        assert all(c.num_tokens <= 8 for c in out.chunks)
        if out.is_decode:
            fits = [b for b in config.decode_buckets if b >= len(out.chunks)]
            assert out.num_decode_slots == min(fits)


@pytest.mark.parametrize("mode", ["corun", "default", "batch_invariant"])
def test_preemption_swaps_and_never_recomputes(mode):
    # 16 blocks of 4 tokens = 64 tokens of cache for 4 sequences growing to ~30 tokens each.
    sim = Sim(_config(mode, max_num_seqs=4, max_num_batched_tokens=16), num_blocks=16)
    rng = random.Random(0)
    lengths = [rng.randint(10, 20) for _ in range(6)]
    for n in lengths:
        sim.add(n, max_tokens=12)
    sim.run()
    assert sim.sched.num_preemptions > 0, "the test did not force a preemption"
    assert any(out.swap_out for out in sim.steps) and any(out.swap_in for out in sim.steps)
    for seq_id, n in enumerate(lengths):
        assert sim.computed[seq_id] == list(range(n + 11)), f"seq {seq_id} recomputed or skipped"
    assert sim.sched.block_manager.num_free_blocks == 16


def test_abort_frees_blocks_and_leaves_others_running():
    sim = Sim(_config("corun"), num_blocks=32)
    a, b = sim.add(6, max_tokens=5), sim.add(6, max_tokens=5)
    for _ in range(3):
        sim.step()
    removed = sim.sched.abort(a.request_id)
    assert removed == [a] and a.block_table == []
    sim.run()
    assert b.num_output_tokens == 5 and sim.sched.block_manager.num_free_blocks == 32


def test_corun_decode_never_exceeds_b_and_waiting_sequences_keep_arrival_order():
    """max_num_seqs bounds the sequences holding KV; B bounds a decode step. Decode-ready
    sequences beyond B wait, and the B slots go to the earliest arrivals."""
    sim = Sim(_config("corun", max_num_seqs=4, decode_batch_size=2), num_blocks=64)
    for _ in range(5):
        sim.add(4, max_tokens=3)
    ahead = False
    while sim.sched.has_unfinished():
        ready = sorted(s.seq_id for s in sim.sched.running if not s.is_prefilling)
        out = sim.step()
        assert len(sim.sched.running) <= 4
        if out.is_decode:
            assert out.num_decode_slots == 2 and len(out.chunks) <= 2
            assert [c.seq.seq_id for c in out.chunks] == ready[: len(out.chunks)]
            ahead |= len(ready) > 2
    assert ahead, "no sequence ever waited for a decode slot"


def test_batch_invariant_cuts_chunks_only_at_the_prefill_tile():
    """batch_invariant on the Triton backend: a chunk the leftover budget cuts ends at a multiple
    of the prefill kernel's query tile (64 rows in fp32), a prompt's last chunk anywhere; default
    cuts wherever the budget ends (the control)."""
    def cuts(mode: str) -> list[int]:
        config = _config(mode, backend="triton", dtype="float32", max_num_seqs=4,
                         max_model_len=512, prefill_chunk_size=128, max_num_batched_tokens=150)
        assert config.prefill_alignment == 64
        sim = Sim(config, num_blocks=512)
        for n in (70, 300, 90, 200):
            sim.add(n, max_tokens=2)
        sim.run()
        return [c.end for out in sim.steps if not out.is_decode for c in out.chunks
                if c.seq.is_prefilling or c.end < c.seq.num_prompt_tokens]

    aligned = cuts("batch_invariant")
    assert aligned and all(end % 64 == 0 for end in aligned)
    assert any(end % 64 for end in cuts("default")), "default never cut off the tile: vacuous"


@pytest.mark.parametrize("mode", ["corun", "default", "batch_invariant"])
def test_preemption_takes_only_later_arrivals(mode, monkeypatch):
    """A sequence that needs blocks preempts itself or a later arrival, never an earlier one.
    Under corun a prefilling sequence swapped in this step is protected from preemption, and
    it used to take an earlier, decoding sequence's blocks in its place."""
    inversions: list[tuple[int, int]] = []
    reserving: list[Sequence] = []
    reserve, swap_out = Scheduler.reserve, Scheduler._swap_out

    def watched_reserve(self, seq, num_tokens, out):
        reserving.append(seq)
        try:
            return reserve(self, seq, num_tokens, out)
        finally:
            reserving.pop()

    def watched_swap_out(self, victim, out):
        if reserving and victim.seq_id < reserving[-1].seq_id:
            inversions.append((victim.seq_id, reserving[-1].seq_id))
        return swap_out(self, victim, out)

    monkeypatch.setattr(Scheduler, "reserve", watched_reserve)
    monkeypatch.setattr(Scheduler, "_swap_out", watched_swap_out)
    preemptions = 0
    for seed in range(40):
        rng = random.Random(seed)
        sim = Sim(_config(mode, max_num_seqs=4, max_num_batched_tokens=16),
                  num_blocks=rng.randint(12, 20))
        for _ in range(rng.randint(4, 8)):
            sim.add(rng.randint(6, 24), max_tokens=rng.randint(4, 16))
        sim.run()  # fails if the scheduler stops making progress
        preemptions += sim.sched.num_preemptions
    assert preemptions > 0, "the workloads forced no preemption"
    assert not inversions, f"(victim, preempting sequence) with the victim earlier: {inversions}"


@pytest.mark.parametrize(("free_blocks", "comes_back"), [(3, False), (4, True)])
def test_a_prefilling_sequence_comes_back_when_its_next_chunk_fits(free_blocks, comes_back):
    """A swapped sequence 8 tokens into a 20-token prompt (C = 8, blocks of 4) needs 2 blocks
    for its cache and 2 more for its next chunk: with 3 free it stays swapped (room for one
    more token only would bring it back to wait, and be swapped out again before it ran)."""
    sched = Scheduler(_config("corun", prefill_chunk_size=8), free_blocks)
    seq = Sequence(0, "r0", 0, [7] * 20, SamplingParams(max_tokens=4), seed=1)
    seq.num_computed_tokens = 8
    seq.status = SequenceStatus.SWAPPED
    sched.swapped.append(seq)
    out = sched.schedule()
    assert (seq in out.swap_in) is comes_back
    assert (seq in sched.swapped) is not comes_back
