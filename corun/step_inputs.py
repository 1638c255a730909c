"""Static step inputs: one device buffer (and its pinned host mirror) that every step's tensors
are views of, filled on the host and copied to the device once per step.

A ``StepBuffers`` has fixed capacities (tokens, sequence rows, sample rows) and typed regions at
fixed byte offsets: input ids, positions, KV slots, token mask, block tables, cu_seqlens, context
and decode lengths, the LM-head rows, and the sampling parameters of each sample row. The views of
one ``StepShape`` are prefixes of those regions and are built once per shape (``bind``), so the
``ForwardBatch`` a CUDA graph was captured with is the one every later step of that shape fills.

``fill`` writes a step's values, padding included (dummy tokens: id 0, position 0, slot -1, mask
False; dummy chunk rows: zero length, an all-zero block row; dummy decode slots, also those of a
dynamic bucket's decode rows: seq_len 0; dummy sample rows: row 0, greedy), into the host
mirror through numpy, then one ``copy_(non_blocking=True)`` moves the whole buffer. On the CPU
the host buffer *is* the device buffer: nothing is copied.

Host values that the forward needs as Python ints (a dynamic step's ``max_q_len``, the decode grid
bound, MLA's per-sequence context lengths) travel in the ``StepHost`` returned by ``fill``; for a
fixed shape under a graph they are constants of the shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from corun.sampler import seed_to_int64
from corun.scheduler import ScheduledChunk
from corun.step import StepShape
from models.forward_batch import ForwardBatch, KVCache, OpsConfig

# (name, dtype, capacity key). Regions are laid out in this order, each 8-byte aligned.
_FIELDS = (
    ("input_ids", torch.int64, "tokens"),
    ("positions", torch.int64, "tokens"),
    ("slot_mapping", torch.int64, "tokens"),
    ("sample_rows", torch.int64, "samples"),
    ("seeds", torch.int64, "samples"),
    ("sample_positions", torch.int64, "samples"),
    ("block_tables", torch.int32, "table"),
    ("cu_seqlens_q", torch.int32, "seqs+1"),
    ("context_lens", torch.int32, "seqs"),
    ("seq_lens", torch.int32, "seqs"),
    ("top_k", torch.int32, "samples"),
    ("sample_indices", torch.int32, "samples"),
    ("temperature", torch.float32, "samples"),
    ("top_p", torch.float32, "samples"),
    ("token_mask", torch.bool, "tokens"),
)
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32,
          torch.bool: np.bool_}


@dataclass
class StepHost:
    """What one filled step tells the host besides its tensors."""

    max_q_len: int
    max_seq_len: int
    context_lens: tuple[int, ...]  # per prefill chunk row (real rows only)
    all_greedy: bool
    want_logprobs: bool
    max_top_logprobs: int = 0  # the largest top-N a sample row asked for
    any_processing: bool = False  # a sample row's request processes its logits
    # Rows [start, end) of each prefill chunk whose sequence wants prompt logprobs, by (seq id,
    # chunk start): a packed step can hold several chunks of one prompt.
    prefill_rows: dict[tuple[int, int], tuple[int, int]] | None = None


@dataclass
class BoundStep:
    """The views of one shape: the forward's inputs and the sampler's per-row parameters."""

    shape: StepShape
    input_ids: torch.Tensor
    batch: ForwardBatch
    sample_rows: torch.Tensor | None  # None: every row samples (decode)
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    sample_indices: torch.Tensor
    sample_positions: torch.Tensor


class StepBuffers:
    """Capacity-sized static inputs of one stream of steps (decode, or prefill)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_samples: int, block_width: int,
                 block_size: int, device: torch.device, arrival_heads: int = 0) -> None:
        self.block_width, self.block_size, self.device = block_width, block_size, device
        # Decode attention's fused-combine arrival counts (ForwardBatch.decode_arrivals), one per
        # (row, kv head); zeros, and every launch leaves them so. None: not fused.
        self.decode_arrivals = torch.zeros(max_seqs * arrival_heads, dtype=torch.int32,
                                           device=device) if arrival_heads else None
        sizes = {"tokens": max_tokens, "samples": max_samples, "seqs": max_seqs,
                 "seqs+1": max_seqs + 1, "table": max_seqs * block_width}
        self.capacity = (max_tokens, max_seqs, max_samples)
        offsets, offset = {}, 0
        for name, dtype, key in _FIELDS:
            offsets[name] = (offset, sizes[key], dtype)
            offset += -(-sizes[key] * dtype.itemsize // 8) * 8
        self.num_bytes = offset
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(offset, dtype=torch.uint8, pin_memory=on_cuda)
        self.dev = torch.zeros(offset, dtype=torch.uint8, device=device) if on_cuda else self.host
        self._host_np = {}
        self._dev_view = {}
        raw = self.host.numpy()
        for name, (start, count, dtype) in offsets.items():
            stop = start + count * dtype.itemsize
            self._host_np[name] = raw[start:stop].view(_NUMPY[dtype])
            self._dev_view[name] = self.dev[start:stop].view(dtype)
        self._host_np["block_tables"] = self._host_np["block_tables"].reshape(max_seqs,
                                                                              block_width)
        self._bound: dict[tuple, BoundStep] = {}
        self._copied = torch.cuda.Event() if on_cuda else None

    def release(self) -> None:
        """Drop the buffers (a destroyed runner's); the views bound so far keep theirs alive."""
        self._bound.clear()
        self._dev_view.clear()
        self.decode_arrivals = None
        self._host_np.clear()

    # -- views --------------------------------------------------------------------------------

    def fits(self, shape: StepShape) -> bool:
        tokens, seqs, samples = self.capacity
        return (shape.num_tokens <= tokens and shape.num_seqs <= seqs
                and shape.num_sample_rows <= samples)

    def bind(self, shape: StepShape, kv_cache: KVCache, ops: OpsConfig, max_seq_len: int,
             host: StepHost | None = None, cache: bool = True,
             routed_experts: object | None = None) -> BoundStep:
        """The views of ``shape``. A fixed shape's are built once (a graph captures them) unless
        ``cache`` is False; a dynamic step's host ints come from ``host``."""
        cache = cache and shape.is_fixed
        if cache and shape in self._bound:
            return self._bound[shape]
        if not self.fits(shape):
            raise ValueError(f"shape: {shape} exceeds the step buffers' capacity {self.capacity}")
        v = self._dev_view
        t, n, r, nd = shape.num_tokens, shape.num_seqs, shape.num_sample_rows, \
            shape.num_decode_tokens
        tables = v["block_tables"][: n * self.block_width].view(n, self.block_width)
        common = dict(positions=v["positions"][:t], slot_mapping=v["slot_mapping"][:t],
                      block_tables=tables, kv_cache=kv_cache, ops=ops,
                      token_mask=v["token_mask"][:t], routed_experts=routed_experts)
        if not shape.is_prefill:
            batch = ForwardBatch(is_prefill=False, seq_lens=v["seq_lens"][:n],
                                 max_seq_len=max_seq_len,
                                 decode_arrivals=self.decode_arrivals, **common)
        else:
            num_chunks = n - nd
            batch = ForwardBatch(
                is_prefill=True, cu_seqlens_q=v["cu_seqlens_q"][: num_chunks + 1],
                context_lens=v["context_lens"][:num_chunks],
                max_q_len=shape.max_q_len if shape.is_fixed else host.max_q_len,
                seq_lens=v["seq_lens"][:nd] if nd else None,
                max_seq_len=max_seq_len, num_decode_tokens=nd,
                context_lens_host=None if shape.is_fixed else host.context_lens,
                decode_arrivals=self.decode_arrivals if nd else None, **common)
        bound = BoundStep(
            shape=shape, input_ids=v["input_ids"][:t], batch=batch,
            sample_rows=v["sample_rows"][:r] if shape.is_prefill else None,
            temperature=v["temperature"][:r], top_k=v["top_k"][:r], top_p=v["top_p"][:r],
            seeds=v["seeds"][:r], sample_indices=v["sample_indices"][:r],
            sample_positions=v["sample_positions"][:r])
        if cache:
            self._bound[shape] = bound
        return bound

    # -- filling ------------------------------------------------------------------------------

    def fill(self, shape: StepShape, chunks: list[ScheduledChunk]) -> StepHost:
        """Write one step (padded to ``shape``) into the host mirror and copy it to the device.

        Prefill rows: the decode tokens of a dynamic mixed step first (one row each), then the
        prefill chunks back to back; sample rows in ``chunks`` order.
        """
        if self._copied is not None:
            self._copied.synchronize()  # the last copy out of the host mirror has finished
        h = self._host_np
        size = self.block_size
        t, n, r = shape.num_tokens, shape.num_seqs, shape.num_sample_rows
        ids, positions, slots, mask = (h["input_ids"][:t], h["positions"][:t],
                                       h["slot_mapping"][:t], h["token_mask"][:t])
        tables = h["block_tables"][:n]
        tables.fill(0)
        decodes = [c for c in chunks if not c.seq.is_prefilling] if shape.is_prefill else chunks
        prefills = [c for c in chunks if c.seq.is_prefilling] if shape.is_prefill else []
        # A prefill shape's chunks start after its decode rows: the real decode tokens, then (in
        # a dynamic bucket) dummy decode slots up to the shape's count.
        first = shape.num_decode_tokens if shape.is_prefill else len(decodes)
        if len(decodes) > first:
            raise ValueError(f"shape: {shape} has {first} decode rows, the step "
                             f"{len(decodes)} decode tokens")
        mask.fill(False)
        row_of: dict[int, int] = {}
        for i, chunk in enumerate(decodes):
            seq, pos = chunk.seq, chunk.start
            table = seq.block_table
            ids[i] = seq.token_ids[pos]
            positions[i] = pos
            slots[i] = table[pos // size] * size + pos % size
            tables[i, : len(table)] = table
            row_of[id(chunk)] = i
        mask[: len(decodes)] = True
        dummies = slice(len(decodes), first)
        ids[dummies], positions[dummies], slots[dummies] = 0, 0, -1
        row = first
        cu = h["cu_seqlens_q"]
        ctx = h["context_lens"]
        cu[0] = 0
        context_lens = []
        prompt_rows: dict[tuple[int, int], tuple[int, int]] = {}
        for j, chunk in enumerate(prefills):
            seq, start, end = chunk.seq, chunk.start, chunk.end
            if seq.params.prompt_logprobs is not None and seq.sample_index == 0:
                prompt_rows[seq.seq_id, start] = (row, row + chunk.num_tokens)
            table = np.asarray(seq.block_table, dtype=np.int64)
            span = slice(row, row + chunk.num_tokens)
            ids[span] = seq.token_ids[start:end]
            pos = np.arange(start, end)
            positions[span] = pos
            slots[span] = table[pos // size] * size + pos % size
            mask[span] = True
            tables[first + j, : len(table)] = table
            row += chunk.num_tokens
            cu[j + 1] = row - first
            ctx[j] = end
            context_lens.append(end)
            row_of[id(chunk)] = row - 1
        # Padding: dummy tokens, chunk rows and decode slots (see the module docstring).
        ids[row:] = 0
        positions[row:] = 0
        slots[row:] = -1
        if shape.is_prefill:
            num_chunks = n - shape.num_decode_tokens
            cu[len(prefills) + 1 : num_chunks + 1] = cu[len(prefills)]
            ctx[len(prefills) : num_chunks] = 0
            seq_lens = h["seq_lens"][:first]
        else:
            seq_lens = h["seq_lens"][:n]
        seq_lens[: len(decodes)] = [c.end for c in decodes]
        seq_lens[len(decodes):] = 0
        sampling = [c for c in chunks if c.samples]
        params = [c.seq.params for c in sampling]
        if shape.is_prefill:
            rows = h["sample_rows"][:r]
            rows[: len(sampling)] = [row_of[id(c)] for c in sampling]
            rows[len(sampling):] = 0
        k = len(sampling)
        h["temperature"][:k] = [p.temperature for p in params]
        h["top_k"][:k] = [p.effective_top_k for p in params]
        h["top_p"][:k] = [p.top_p for p in params]
        h["seeds"][:k] = [seed_to_int64(c.seq.seed) for c in sampling]
        h["sample_indices"][:k] = [c.seq.sample_index for c in sampling]
        # The sampled token lands at index num_tokens: its absolute position.
        h["sample_positions"][:k] = [c.seq.num_tokens for c in sampling]
        for name, value in (("temperature", 0.0), ("top_k", 0), ("top_p", 1.0), ("seeds", 0),
                            ("sample_indices", 0), ("sample_positions", 0)):
            h[name][k:r] = value
        if self.dev is not self.host:
            self.dev.copy_(self.host, non_blocking=True)
            self._copied.record()
        longest = max((c.end for c in (decodes or prefills)), default=1)
        return StepHost(max_q_len=max((c.num_tokens for c in prefills), default=0),
                        max_seq_len=longest, context_lens=tuple(context_lens),
                        all_greedy=all(p.is_greedy for p in params),
                        want_logprobs=any(p.needs_logprobs for p in params),
                        max_top_logprobs=max((p.logprobs or 0 for p in params), default=0),
                        any_processing=any(p.has_logits_processing for p in params),
                        prefill_rows=prompt_rows or None)
