"""The scheduler: queues, KV blocks, preemption, and the mode's batching policy. Pure Python.

One ``Scheduler`` serves all three modes; what differs is the ``BatchingPolicy`` chosen from
``config.mode`` (DESIGN.md, "Three modes, one engine"):

- ``DynamicPolicy`` (``default`` and ``batch_invariant``): continuous batching. Each step takes the
  running sequences first (a decode token each, or their next prefill chunk), then admits waiting
  requests, all under the token budget ``max_num_batched_tokens``; prefill chunks and decode tokens
  share one step. A step of decode tokens only is padded up to the next graph bucket (1, 2, 4, ...).
- ``CoRunPolicy`` (``corun``): prefill chunks end at multiples of ``prefill_chunk_size`` C (so a
  request's chunking is a function of its own length) and run in *fixed-shape* prefill steps:
  ``packed`` (several requests' whole chunks in one step of exactly T tokens and R chunk rows,
  padded with dummies; a chunk is never cut to fill the step) or ``isolated`` (the paper's: one
  chunk, padded to its bucket). *Fixed-shape decode*: every decode step has exactly ``B`` slots,
  dummies in the empty ones; decode-ready sequences beyond B wait for a slot in arrival order.
  The stall bound is a token budget: while sequences are decoding, prefill steps whose padded
  sizes add up to at most ``prefill_token_budget`` run between two decode steps (always at least
  one when prefill work is waiting). With ``overlap_prefill_decode`` a decode step also carries
  one prefill step (a *combined* step, run on two CUDA streams), which counts against the budget.
  Every step's ``StepShape`` is decided here, so the runner only fills and replays.

Prefix caching: a waiting sequence is admitted with the cached prefix of its prompt it can take
(``cached_start``: a multiple of ``config.prefix_cache_granularity``, the unit at which the
policies' chunks after it have the bits of an uncached prefill); its first chunk starts there.
After each prefill chunk commits, its prompt blocks in whole units are registered for later
sequences (``corun.kv_cache``; DESIGN.md "Prefix caching").

Preemption keeps the bits: when a sequence cannot get the block it needs, the most recently
arrived running sequence is *swapped out*: the engine copies its KV blocks to host memory and the
blocks are freed; it is swapped back into fresh blocks (same contents, so the same bits) before any
new request is admitted. Nothing is recomputed, so the preempted sequence continues exactly as if
it had never left.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from corun.config import EngineConfig
from corun.kv_cache import BlockManager
from corun.sequence import Sequence, SequenceStatus
from corun.step import StepPart, StepShape


@dataclass
class ScheduledChunk:
    """Tokens ``start .. start + num_tokens - 1`` of ``seq`` go through the model this step."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so its last row is sampled."""
        return self.end == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """One step: its parts (shape + chunks, in batch order), and the KV copies to do first.

    ``chunks`` / ``shape``: the step's main part: a decode part (one token per chunk, padded to
    ``shape.num_seqs`` slots) or a prefill part. ``overlap_chunks`` / ``overlap_shape`` (corun with
    ``overlap_prefill_decode`` only, on a decode step): a prefill part of sequences that are not
    in the decode batch, run beside the decode as its own forward (its own shape, as in a
    prefill-only step); empty otherwise. Both parts are committed as if they had been two steps:
    they touch disjoint sequences and disjoint KV blocks.
    ``swap_out``: (sequence, device blocks) to copy to host *first*; ``swap_in``: sequences whose
    host copy goes into their new ``block_table`` *second*.
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    shape: StepShape | None = None
    overlap_chunks: list[ScheduledChunk] = field(default_factory=list)
    overlap_shape: StepShape | None = None
    swap_out: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    swap_in: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.overlap_chunks

    @property
    def is_decode(self) -> bool:
        return self.shape is not None and not self.shape.is_prefill

    @property
    def num_decode_slots(self) -> int:
        return self.shape.num_seqs if self.is_decode else 0

    @property
    def is_combined(self) -> bool:
        """A decode part and a prefill part in one step (``overlap_prefill_decode``)."""
        return self.is_decode and bool(self.overlap_chunks)

    @property
    def parts(self) -> list[StepPart]:
        parts = [StepPart(self.shape, self.chunks)] if self.chunks else []
        if self.overlap_chunks:
            parts.append(StepPart(self.overlap_shape, self.overlap_chunks))
        return parts

    @property
    def decode_chunks(self) -> list[ScheduledChunk]:
        return self.chunks if self.is_decode else []

    @property
    def prefill_chunks(self) -> list[ScheduledChunk]:
        return self.overlap_chunks if self.is_decode else self.chunks

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in (*self.chunks, *self.overlap_chunks))


class BatchingPolicy(Protocol):
    def schedule(self, sched: Scheduler, out: SchedulerOutput) -> None: ...


class Scheduler:
    """Waiting / running / swapped queues over a BlockManager; ``schedule()`` asks the policy."""

    def __init__(self, config: EngineConfig, num_kv_blocks: int) -> None:
        self.config = config
        self.block_manager = BlockManager(num_kv_blocks, config.block_size,
                                          config.prefix_cache_granularity)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # arrival (seq_id) order
        self.swapped: list[Sequence] = []  # arrival (seq_id) order
        self.holding = False  # no admission while set (LLMEngine.hold_admissions)
        self.policy: BatchingPolicy = (
            CoRunPolicy(config) if config.is_corun else DynamicPolicy(config)
        )
        self.num_preemptions = 0
        self._protected: set[int] = set()  # seq ids that may not be preempted this step

    # -- queues --------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def has_started(self) -> bool:
        """Whether a sequence has run a step: running, swapped out, or waiting with computed
        tokens or outputs (nothing else holds results of the current weights)."""
        return bool(self.running or self.swapped) or any(
            s.num_computed_tokens or s.output_token_ids for s in self.waiting)

    def abort(self, request_id: str) -> list[Sequence]:
        """Remove the request's unfinished sequences, freeing their blocks; returns them."""
        removed = [s for s in (*self.waiting, *self.running, *self.swapped)
                   if s.request_id == request_id]
        for seq in removed:
            if seq in self.running:
                self.running.remove(seq)
                self.block_manager.release(seq)
            elif seq in self.swapped:
                self.swapped.remove(seq)
            else:
                self.waiting.remove(seq)
            seq.status = SequenceStatus.FINISHED
        return removed

    def finish(self, seq: Sequence) -> None:
        """A running sequence is done: free its blocks."""
        self.running.remove(seq)
        self.block_manager.release(seq)
        seq.status = SequenceStatus.FINISHED

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._protected = set()
        self._swap_in(out)
        self.policy.schedule(self, out)
        return out

    def commit(self, out: SchedulerOutput) -> None:
        """After the step ran: the chunks' K/V are in the cache (both parts of a combined step)."""
        self.commit_chunks(out.chunks)
        self.commit_chunks(out.overlap_chunks)

    def commit_chunks(self, chunks: list[ScheduledChunk]) -> None:
        """Commit one part of a step; the parts of a combined step hold disjoint sequences, so
        the order they are committed in changes nothing."""
        for chunk in chunks:
            chunk.seq.num_computed_tokens = chunk.end
            if chunk.start < chunk.seq.num_prompt_tokens:  # a prefill chunk: K/V of the prompt
                self.block_manager.register_prefill(chunk.seq)

    # -- primitives the policies use ------------------------------------------------------------

    @property
    def can_admit(self) -> bool:
        # Swapped sequences come back before anything new is admitted (no starvation); nothing
        # is admitted while admissions are held (a weight update drains the running ones).
        return (bool(self.waiting) and not self.swapped and not self.holding
                and len(self.running) < self.config.max_running_seqs)

    def cached_start(self) -> int:
        """Where the first waiting sequence's first chunk starts: the prompt tokens it would take
        from the prefix cache (0 without caching), a multiple of ``prefix_cache_granularity``."""
        return len(self.block_manager.cached_prefix(self.waiting[0])) * self.config.block_size

    def admit(self, start: int, num_tokens: int) -> Sequence | None:
        """Start the first waiting sequence with its first chunk [start, start + num_tokens) if
        the blocks fit now (``start`` from ``cached_start``: the cached prefix it takes); never
        preempts."""
        seq = self.waiting[0]
        manager = self.block_manager
        prefix = manager.cached_prefix(seq)
        if len(prefix) * self.config.block_size != start:
            raise RuntimeError(f"seq {seq.seq_id}: cached prefix changed between cached_start "
                               f"({start}) and admit ({len(prefix) * self.config.block_size})")
        if not manager.allocator.can_allocate(
                manager.num_blocks_to_admit(seq, prefix, start + num_tokens)):
            return None
        self.waiting.popleft()
        manager.admit(seq, prefix, start + num_tokens)
        seq.status = SequenceStatus.RUNNING
        self._insert_running(seq)
        self._protected.add(seq.seq_id)
        return seq

    def reserve(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Make room for ``num_tokens`` tokens of running ``seq``, preempting later arrivals.

        Returns False when ``seq`` cannot run this step: it was itself the latest arrival and got
        swapped out, or every later holder of blocks is already part of this step.
        """
        while not self.block_manager.can_grow(seq, num_tokens):
            # Only ``seq`` itself or a later arrival gives way: a sequence swapped in this step
            # is protected (its blocks receive the swap-in copy), so without the bound it would
            # preempt an earlier, unprotected one in its place.
            victims = [s for s in self.running
                       if s.seq_id not in self._protected and s.seq_id >= seq.seq_id]
            if not victims:  # only this step's sequences or earlier arrivals hold blocks: wait
                return False
            victim = max(victims, key=lambda s: s.seq_id)
            self._swap_out(victim, out)
            if victim is seq:
                return False
        self.block_manager.grow(seq, num_tokens)
        self._protected.add(seq.seq_id)
        return True

    def try_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give running ``seq`` room for ``num_tokens`` tokens if the blocks are free; never
        preempts (a packed prefill step's extra chunks only use what is free)."""
        if not self.block_manager.can_grow(seq, num_tokens):
            return False
        self.block_manager.grow(seq, num_tokens)
        self._protected.add(seq.seq_id)
        return True

    def _swap_out(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.num_preemptions += 1
        seq.num_preemptions += 1
        num_cached = self.block_manager.blocks_for(seq.num_computed_tokens)
        blocks = seq.block_table[:num_cached]
        self.block_manager.release(seq)
        if seq.num_computed_tokens == 0:
            seq.status = SequenceStatus.WAITING  # nothing cached yet: simply start again later
            self.waiting.appendleft(seq)
            return
        seq.status = SequenceStatus.SWAPPED
        out.swap_out.append((seq, blocks))
        self.swapped.append(seq)
        self.swapped.sort(key=lambda s: s.seq_id)

    def _swap_in(self, out: SchedulerOutput) -> None:
        """Bring swapped sequences back, oldest first, while their cache and their next step
        fit: one token, or for a sequence still prefilling, a chunk (up to
        ``prefill_chunk_size`` tokens). With room for one token only, a prefilling sequence came
        back to find no room for its chunk (``reserve`` does not let it preempt the earlier
        arrivals) and was often swapped out again before it ran: over 300 random tight-pool
        workloads, 239 of 1381 swap-ins; with the chunk counted, 19 of 1103."""
        while self.swapped and len(self.running) < self.config.max_running_seqs:
            seq = self.swapped[0]
            next_end = seq.num_computed_tokens + 1
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                next_end = min(seq.num_prompt_tokens,
                               seq.num_computed_tokens + self.config.prefill_chunk_size)
            need = self.block_manager.blocks_for(next_end)
            if not self.block_manager.allocator.can_allocate(need):
                return
            self.swapped.pop(0)
            self.block_manager.grow(seq, seq.num_computed_tokens)
            seq.status = SequenceStatus.RUNNING
            self._insert_running(seq)
            self._protected.add(seq.seq_id)  # its blocks are filled by this step's swap-in copy
            out.swap_in.append(seq)

    def _insert_running(self, seq: Sequence) -> None:
        self.running.append(seq)
        self.running.sort(key=lambda s: s.seq_id)


def _bucket(size: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= size)


class DynamicPolicy:
    """default / batch_invariant: running sequences first, then admissions, under a token budget.

    Under batch_invariant a chunk the leftover budget cuts short ends at a multiple of
    ``prefill_alignment`` (the prefill kernel's query tile): the kernel promises a row the same
    bits whole or chunked only for chunks aligned so; a prompt's last chunk may end anywhere.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.alignment = config.prefill_alignment if config.kernel_mode.is_batch_invariant else 1

    def _chunk_len(self, seq: Sequence, start: int, budget: int) -> int:
        """Tokens of ``seq``'s next prefill chunk from ``start`` within ``budget`` (0: no
        aligned cut fits)."""
        remaining = seq.num_tokens - start
        n = min(remaining, budget, self.config.prefill_chunk_size)
        if n < remaining and self.alignment > 1:
            n = (start + n) // self.alignment * self.alignment - start
        return max(n, 0)

    def schedule(self, sched: Scheduler, out: SchedulerOutput) -> None:
        budget = self.config.max_num_batched_tokens
        for seq in list(sched.running):
            if budget == 0:
                break
            if seq not in sched.running:  # preempted earlier in this loop
                continue
            n = self._chunk_len(seq, seq.num_computed_tokens, budget) if seq.is_prefilling else 1
            if n == 0 or not sched.reserve(seq, seq.num_computed_tokens + n, out):
                continue
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        while budget > 0 and sched.can_admit:
            start = sched.cached_start()
            n = self._chunk_len(sched.waiting[0], start, budget)
            seq = sched.admit(start, n) if n else None
            if seq is None:
                break
            out.chunks.append(ScheduledChunk(seq, start, n))
            budget -= n
        if not out.chunks:
            return
        if all(not c.seq.is_prefilling for c in out.chunks):
            out.shape = StepShape.decode(_bucket(len(out.chunks), self.config.decode_buckets))
        else:
            out.shape = StepShape.dynamic(out.chunks)


class CoRunPolicy:
    """corun: aligned prefill chunks in fixed-shape steps (packed or isolated); decode at exactly
    B slots; prefill steps between two decode steps bounded by a token budget."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.num_prefill_tokens_since_decode = 0

    def _chunk_len(self, seq: Sequence, start: int) -> int:
        # Chunks end at the next multiple of C (or at the prompt's end): a function of the
        # sequence's own length only, whatever the schedule around it.
        size = self.config.prefill_chunk_size
        return min((start // size + 1) * size, seq.num_tokens) - start

    def schedule(self, sched: Scheduler, out: SchedulerOutput) -> None:
        config = self.config
        decoding = [s for s in sched.running if not s.is_prefilling]
        # While sequences decode, a prefill step runs only if it fits in what is left of the
        # budget since the last decode step (the first one always may).
        room = None
        if decoding and self.num_prefill_tokens_since_decode > 0:
            room = config.prefill_token_budget - self.num_prefill_tokens_since_decode
        if not decoding or room is None or room > 0:
            if self._schedule_prefill(sched, out, main=True, room=room):
                return
        num_slots = config.num_decode_slots
        for seq in [s for s in sched.running if not s.is_prefilling]:
            if len(out.chunks) == num_slots:  # the rest wait for a slot, in arrival order
                break
            if seq not in sched.running:  # preempted to make room for an earlier sequence
                continue
            if sched.reserve(seq, seq.num_tokens, out):
                out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1))
        if out.chunks:
            out.shape = StepShape.decode(num_slots)
            self.num_prefill_tokens_since_decode = 0
            # The decode slots are reserved (protected) first, so the prefill part can never
            # preempt a sequence of this decode batch; a prefilling sequence is never decoding,
            # so the two parts hold disjoint sequences.
            if config.overlap_prefill_decode:
                self._schedule_prefill(sched, out, main=False, room=None)
        elif decoding:
            # Every decoding sequence was swapped out or must wait: a prefill-only step instead.
            self._schedule_prefill(sched, out, main=True, room=None)

    def _schedule_prefill(self, sched: Scheduler, out: SchedulerOutput, main: bool,
                          room: int | None) -> bool:
        """Schedule one prefill step whose padded size fits in ``room`` (None: any size)."""
        config = self.config
        if config.is_packed_prefill:
            shape = StepShape.packed_prefill(config.prefill_step_tokens,
                                             config.max_prefill_seqs_per_step,
                                             config.prefill_chunk_size)
            if room is not None and shape.num_tokens > room:
                return False
            chunks = self._packed(sched, out)
        else:
            chunks = self._isolated(sched, out, room)
            shape = StepShape.isolated_prefill(
                _bucket(chunks[0].num_tokens, config.prefill_buckets)) if chunks else None
        if not chunks:
            return False
        if main:
            out.chunks, out.shape = chunks, shape
        else:
            out.overlap_chunks, out.overlap_shape = chunks, shape
        self.num_prefill_tokens_since_decode += shape.num_tokens
        return True

    def _isolated(self, sched: Scheduler, out: SchedulerOutput,
                  room: int | None) -> list[ScheduledChunk]:
        # Finish the earliest arrival's prompt before starting another (a sequence swapped back in
        # in the middle of its prompt continues here too).
        prefilling = [s for s in sched.running if s.is_prefilling]
        seq = prefilling[0] if prefilling else sched.waiting[0] if sched.can_admit else None
        if seq is None:
            return []
        start = seq.num_computed_tokens if prefilling else sched.cached_start()
        n = self._chunk_len(seq, start)
        if room is not None and _bucket(n, self.config.prefill_buckets) > room:
            return []
        if prefilling:
            if not sched.reserve(seq, start + n, out):
                return []
        elif sched.admit(start, n) is None:
            return []
        return [ScheduledChunk(seq, start, n)]

    def _packed(self, sched: Scheduler, out: SchedulerOutput) -> list[ScheduledChunk]:
        """Whole aligned chunks, in arrival order, while they fit in T tokens and R rows.

        Prompts already being prefilled go first (the first chunk of the earliest one may preempt
        later arrivals, so it always progresses), then waiting requests are admitted. A chunk that
        does not fit ends its sequence's share of this step (its later chunks wait too); a shorter
        chunk of a later sequence may still fit. A chunk is never cut to fill the step.
        """
        config = self.config
        chunks: list[ScheduledChunk] = []
        room = config.prefill_step_tokens
        max_rows = config.max_prefill_seqs_per_step

        def add_chunks(seq: Sequence, start: int, may_preempt: bool) -> None:
            nonlocal room
            while start < seq.num_tokens and len(chunks) < max_rows:
                n = self._chunk_len(seq, start)
                if n > room:
                    return
                grown = (sched.reserve(seq, start + n, out) if may_preempt and not chunks
                         else sched.try_grow(seq, start + n))
                if not grown:
                    return
                chunks.append(ScheduledChunk(seq, start, n))
                room -= n
                start += n

        for seq in [s for s in sched.running if s.is_prefilling]:
            if seq in sched.running:  # not preempted by an earlier chunk of this step
                add_chunks(seq, seq.num_computed_tokens, may_preempt=True)
        while sched.can_admit and len(chunks) < max_rows:
            seq = sched.waiting[0]
            start = sched.cached_start()
            n = self._chunk_len(seq, start)
            if n > room or sched.admit(start, n) is None:
                break
            chunks.append(ScheduledChunk(seq, start, n))
            room -= n
            add_chunks(seq, start + n, may_preempt=False)
        return chunks
