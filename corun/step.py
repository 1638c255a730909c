"""One engine step as a value, from the scheduler to the graph. Pure Python.

The scheduler decides a step's chunks *and* its shape (``StepShape``): every tensor the model sees
in that step has a size given by the shape alone. The model runner keeps one set of static input
buffers, fills the shape's prefix of them from the chunks (one host-to-device copy), and replays
the shape's CUDA graph, or runs the forward eagerly on the same views when there is none. A step
is therefore a ``StepPart`` (a shape and its chunks), or two of them when a corun decode step
carries a prefill part on a second stream.

Shapes by mode (DESIGN.md, "Three modes, one engine"):

- decode (every mode): ``B`` slots under corun, a bucket 1, 2, 4, ... under the dynamic modes;
  one token per slot, dummy slots padded.
- corun prefill: ``packed``: ``T`` tokens in ``R`` chunk rows, every row's chunk aligned at
  multiples of C, dummies after the real tokens; ``isolated``: one chunk padded to its bucket.
  Both are fixed shapes (``is_fixed``): a request's rows go through exactly the same kernels and
  configs whoever else is in the step, since every op is position-invariant at a fixed shape.
- dynamic prefill (default, batch_invariant): the exact sizes of the step's chunks and mixed-in
  decode tokens (``is_fixed`` False): eager, never captured. A small one runs padded to a
  ``dynamic_bucket`` instead (``smallest_bucket``), a fixed shape with a CUDA graph: T tokens,
  its decode tokens padded to ``nd`` (``dynamic_decode_counts``), then up to ``prefill_rows``
  chunk rows (``EngineConfig.dynamic_graph_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from corun.scheduler import ScheduledChunk


@dataclass(frozen=True)
class StepShape:
    """The sizes of one forward; hashable, the key of its buffers' views and of its graph.

    ``num_tokens`` rows go through the model; ``num_seqs`` block-table rows (decode slots, or a
    prefill step's chunk rows, the mixed-in decode tokens' rows first); ``num_sample_rows`` rows
    reach the LM head and the sampler; ``max_q_len`` bounds a prefill chunk (it sizes the
    attention grid); ``num_decode_tokens`` is the leading decode tokens of a dynamic mixed step.
    """

    is_prefill: bool
    num_tokens: int
    num_seqs: int
    num_sample_rows: int
    max_q_len: int = 0
    num_decode_tokens: int = 0
    is_fixed: bool = True

    def __post_init__(self) -> None:
        if self.num_tokens < 1 or self.num_seqs < 1 or self.num_sample_rows < 0:
            raise ValueError(f"StepShape: sizes must be positive, got {self}")
        if not self.is_prefill and not (self.num_tokens == self.num_seqs == self.num_sample_rows):
            raise ValueError(f"StepShape: a decode step has one token and one sample per slot, "
                             f"got {self}")

    @classmethod
    def decode(cls, num_slots: int) -> StepShape:
        return cls(False, num_slots, num_slots, num_slots)

    @classmethod
    def packed_prefill(cls, num_tokens: int, num_seqs: int, chunk_size: int) -> StepShape:
        return cls(True, num_tokens, num_seqs, num_seqs, max_q_len=chunk_size)

    @classmethod
    def isolated_prefill(cls, bucket: int) -> StepShape:
        return cls(True, bucket, 1, 1, max_q_len=bucket)

    @classmethod
    def dynamic_bucket(cls, num_tokens: int, num_decode_tokens: int, prefill_rows: int,
                       max_chunk: int) -> StepShape:
        """A dynamic step's padded shape: ``num_decode_tokens`` decode rows (real ones first,
        then dummy slots), then ``prefill_rows`` chunk rows holding the rest of the tokens, each
        chunk at most ``max_chunk`` tokens (the scheduler's cap: prefill_chunk_size, and no
        longer than a sequence); every row may sample."""
        if not 0 <= num_decode_tokens < num_tokens or prefill_rows < 1 or max_chunk < 1:
            raise ValueError(f"StepShape.dynamic_bucket: needs 0 <= decode tokens < tokens, a "
                             f"prefill row and a chunk, got {num_tokens} tokens, "
                             f"{num_decode_tokens} decode tokens, {prefill_rows} rows, "
                             f"chunks of {max_chunk}")
        rows = num_decode_tokens + prefill_rows
        return cls(True, num_tokens, rows, rows,
                   max_q_len=min(num_tokens - num_decode_tokens, max_chunk),
                   num_decode_tokens=num_decode_tokens)

    @classmethod
    def dynamic(cls, chunks: list[ScheduledChunk]) -> StepShape:
        """The exact shape of a dynamic-mode step (decode tokens first, then prefill chunks)."""
        decodes = [c for c in chunks if not c.seq.is_prefilling]
        prefills = [c for c in chunks if c.seq.is_prefilling]
        if not prefills:
            raise ValueError("StepShape.dynamic: a step without prefill chunks is a decode step")
        return cls(True, sum(c.num_tokens for c in chunks), len(chunks),
                   sum(1 for c in chunks if c.samples),
                   max_q_len=max(c.num_tokens for c in prefills),
                   num_decode_tokens=len(decodes), is_fixed=False)

    @property
    def num_prefill_seqs(self) -> int:
        return self.num_seqs - self.num_decode_tokens


@dataclass
class StepPart:
    """One forward of a step: its shape and the chunks (in batch order) that fill it."""

    shape: StepShape
    chunks: list[ScheduledChunk]

    @property
    def sampling_chunks(self) -> list[ScheduledChunk]:
        """The chunks whose last row is sampled, in the order of the sample rows."""
        return [c for c in self.chunks if c.samples]


def dynamic_decode_counts(max_num_seqs: int) -> list[int]:
    """Decode-token counts of the dynamic buckets: none, powers of 4, and the most a mixed step
    holds (one sequence is prefilling). A dummy decode slot costs a row of the GEMMs and an
    attention program that exits at once, so coarse steps keep the graph count small."""
    most = max_num_seqs - 1
    counts, count = [0], 4
    while count < most:
        counts.append(count)
        count *= 4
    return counts + [most] if most > 0 else counts


def dynamic_buckets(token_counts: list[int], decode_counts: list[int], prefill_rows: int,
                    max_chunk: int) -> list[StepShape]:
    """Every padded shape of the dynamic modes' prefill / mixed steps: each token count with
    each decode-token count that leaves room for a prefill token, largest first."""
    shapes = [StepShape.dynamic_bucket(tokens, nd, prefill_rows, max_chunk)
              for tokens in token_counts for nd in sorted(set(decode_counts)) if nd < tokens]
    return sorted(shapes, key=lambda s: (s.num_tokens, s.num_seqs), reverse=True)


def smallest_bucket(shape: StepShape, buckets: list[StepShape]) -> StepShape | None:
    """The smallest bucket a dynamic step fits (fewest tokens, then fewest rows), or None: its
    decode tokens within the bucket's, its prefill tokens within the rest, its chunks within
    the rows and the longest within the bucket's chunk length."""
    fits = [b for b in buckets
            if b.num_decode_tokens >= shape.num_decode_tokens
            and b.max_q_len >= shape.max_q_len
            and b.num_tokens - b.num_decode_tokens >= shape.num_tokens - shape.num_decode_tokens
            and b.num_prefill_seqs >= shape.num_prefill_seqs
            and b.num_sample_rows >= shape.num_sample_rows]
    return min(fits, key=lambda b: (b.num_tokens, b.num_seqs), default=None)
