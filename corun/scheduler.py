"""The scheduler: queues, KV blocks, preemption, and the mode's batching policy. Pure Python.

One ``Scheduler`` serves all three modes; what differs is the ``BatchingPolicy`` chosen from
``config.mode`` (DESIGN.md, "Three modes, one engine"):

- ``DynamicPolicy`` (``default`` and ``batch_invariant``): continuous batching. Each step takes the
  running sequences first (a decode token each, or their next prefill chunk), then admits waiting
  requests, all under the token budget ``max_num_batched_tokens``; prefill chunks and decode tokens
  share one step. A step of decode tokens only is padded up to the next graph bucket (1, 2, 4, ...).
- ``CoRunPolicy`` (``corun``): *isolated prefill*: a prefill step holds one sequence's chunk only,
  chunks end at multiples of ``prefill_chunk_size`` (so a request's chunking is a function of its
  own length); *fixed-shape decode*: every decode step has exactly ``B`` slots, dummies in the empty
  ones. Alternation (the stall bound): while sequences are decoding, at most
  ``max_prefill_steps_between_decodes`` prefill steps run between two decode steps; a decode step
  runs whenever that quota is used up or no prefill work can start. With
  ``overlap_prefill_decode`` a decode step also carries one isolated prefill chunk (a *combined*
  step, run on two CUDA streams): that chunk counts against the quota, so at most
  ``max_prefill_steps_between_decodes - 1`` prefill-only steps run between two decode steps.

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
    """One step: the chunks in batch order, and the KV copies to do before running it.

    ``is_decode``: every chunk is one decode token; the step runs the decode path padded to
    ``num_decode_slots`` rows (a bucket, or B under corun). Otherwise it is a (varlen) prefill step.
    ``overlap_chunks`` (corun with ``overlap_prefill_decode`` only, on a decode step): one isolated
    prefill chunk of a sequence that is not in the decode batch, run beside the decode as its own
    forward (its own shapes, as in a prefill-only step); empty otherwise. Both parts are committed
    as if they had been two steps: they touch disjoint sequences and disjoint KV blocks.
    ``swap_out``: (sequence, device blocks) to copy to host *first*; ``swap_in``: sequences whose
    host copy goes into their new ``block_table`` *second*.
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    is_decode: bool = False
    num_decode_slots: int = 0
    overlap_chunks: list[ScheduledChunk] = field(default_factory=list)
    swap_out: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    swap_in: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.overlap_chunks

    @property
    def is_combined(self) -> bool:
        """A decode part and a prefill part in one step (``overlap_prefill_decode``)."""
        return self.is_decode and bool(self.overlap_chunks)

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
        self.block_manager = BlockManager(num_kv_blocks, config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # arrival (seq_id) order
        self.swapped: list[Sequence] = []  # arrival (seq_id) order
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

    # -- primitives the policies use ------------------------------------------------------------

    @property
    def can_admit(self) -> bool:
        # Swapped sequences come back before anything new is admitted (no starvation).
        return (bool(self.waiting) and not self.swapped
                and len(self.running) < self.config.max_running_seqs)

    def admit(self, num_tokens: int) -> Sequence | None:
        """Start the first waiting sequence if ``num_tokens`` of it fit now; never preempts."""
        seq = self.waiting[0]
        if not self.block_manager.can_grow(seq, num_tokens):
            return None
        self.waiting.popleft()
        self.block_manager.grow(seq, num_tokens)
        seq.status = SequenceStatus.RUNNING
        self._insert_running(seq)
        self._protected.add(seq.seq_id)
        return seq

    def reserve(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Make room for ``num_tokens`` tokens of running ``seq``, preempting later arrivals.

        Returns False when ``seq`` cannot run this step: it was itself the latest arrival and got
        swapped out, or every other holder of blocks is already part of this step.
        """
        while not self.block_manager.can_grow(seq, num_tokens):
            victims = [s for s in self.running if s.seq_id not in self._protected]
            if not victims:  # only sequences already in this step hold blocks: wait a step
                return False
            victim = max(victims, key=lambda s: s.seq_id)
            self._swap_out(victim, out)
            if victim is seq:
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
        """Bring swapped sequences back, oldest first, while their cache (+1 token) fits."""
        while self.swapped and len(self.running) < self.config.max_running_seqs:
            seq = self.swapped[0]
            need = self.block_manager.blocks_for(seq.num_computed_tokens + 1)
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
    """default / batch_invariant: running sequences first, then admissions, under a token budget."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def schedule(self, sched: Scheduler, out: SchedulerOutput) -> None:
        budget = self.config.max_num_batched_tokens
        chunk_cap = self.config.prefill_chunk_size
        for seq in list(sched.running):
            if budget == 0:
                break
            if seq not in sched.running:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed_tokens, budget, chunk_cap) if seq.is_prefilling else 1
            if not sched.reserve(seq, seq.num_computed_tokens + n, out):
                continue
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        while budget > 0 and sched.can_admit:
            n = min(sched.waiting[0].num_uncomputed_tokens, budget, chunk_cap)
            seq = sched.admit(n)
            if seq is None:
                break
            out.chunks.append(ScheduledChunk(seq, 0, n))
            budget -= n
        if out.chunks and all(not c.seq.is_prefilling for c in out.chunks):
            out.is_decode = True
            out.num_decode_slots = _bucket(len(out.chunks), self.config.decode_buckets)


class CoRunPolicy:
    """corun: isolated, aligned prefill chunks; decode at exactly B slots; bounded decode stalls."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.num_prefills_since_decode = 0

    def _chunk_len(self, seq: Sequence) -> int:
        # Chunks end at the next multiple of C (or at the prompt's end): a function of the
        # sequence's own length only, whatever the schedule around it.
        size = self.config.prefill_chunk_size
        start = seq.num_computed_tokens
        return min((start // size + 1) * size, seq.num_tokens) - start

    def schedule(self, sched: Scheduler, out: SchedulerOutput) -> None:
        overlap = self.config.overlap_prefill_decode
        decoding = [s for s in sched.running if not s.is_prefilling]
        # Under overlap, each decode step carries one prefill chunk, which uses up one unit of the
        # quota: only the rest may be spent on prefill-only steps.
        quota = self.config.max_prefill_steps_between_decodes - int(overlap)
        quota_left = self.num_prefills_since_decode < quota
        if not decoding or quota_left:
            if self._schedule_prefill(sched, out.chunks, out):
                self.num_prefills_since_decode += 1
                return
        decoding = [s for s in sched.running if not s.is_prefilling]
        for seq in decoding:
            if seq not in sched.running:  # preempted to make room for an earlier sequence
                continue
            if sched.reserve(seq, seq.num_tokens, out):
                out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1))
        if out.chunks:
            out.is_decode = True
            out.num_decode_slots = self.config.num_decode_slots
            self.num_prefills_since_decode = 0
            # The decode slots are reserved (protected) first, so the prefill part can never
            # preempt a sequence of this decode batch; a prefilling sequence is never decoding,
            # so the two parts hold disjoint sequences.
            if overlap:
                self._schedule_prefill(sched, out.overlap_chunks, out)
        elif overlap and decoding:
            # Every decoding sequence was swapped out or must wait: a prefill-only step instead.
            if self._schedule_prefill(sched, out.chunks, out):
                self.num_prefills_since_decode += 1

    def _schedule_prefill(self, sched: Scheduler, chunks: list[ScheduledChunk],
                          out: SchedulerOutput) -> bool:
        # Finish the earliest arrival's prompt before starting another (a sequence swapped back in
        # in the middle of its prompt continues here too).
        prefilling = [s for s in sched.running if s.is_prefilling]
        if prefilling:
            seq = prefilling[0]
            n = self._chunk_len(seq)
            if not sched.reserve(seq, seq.num_computed_tokens + n, out):
                return False
        elif sched.can_admit:
            seq = sched.waiting[0]
            n = self._chunk_len(seq)
            if sched.admit(n) is None:
                return False
        else:
            return False
        chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
        return True
