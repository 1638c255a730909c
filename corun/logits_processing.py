"""Per-request logits processing before sampling: grammar mask, logit bias, min_tokens, penalties,
min_p.

Each processed row is a function of that row's raw logits and of its own request's params and
tokens only (the structured-output mask first, then vLLM's order: ``logit_bias`` and
``min_tokens``, then the repetition, frequency and presence penalties, then ``min_p`` against the
temperature-scaled distribution), applied to a copy of the rows that ask for processing; those
rows are then sampled by the same sampler with the same per-request noise. So a processed
request's tokens do not depend on what runs beside it, and the rows that ask for nothing are
neither touched nor re-sampled (their bits are the step's).

The processors run on all the rows that ask for them at once, one launch per distinct parameter
value, not one per row (``process_rows``): at B = 128 with a repetition penalty on every row (a
Qwen2.5 checkpoint's generation config sets one for every request), the row-at-a-time form
dispatched 2,305 ops a step, the GPU's blocks of rows (``BLOCK_BYTES``) 55
(experiments/bench_logits_processing.py, counted on the CPU).

The raw logits stay as they were: the logits digest and the reported logprobs are of the model's
output (vLLM's default ``raw_logprobs``).

The penalties read a sequence's tokens through ``PenaltyPool``: dense per-vocabulary rows on the
logits' device that follow the sequence, where a step adds only the tokens appended since the
last one, so a row's work does not grow with the output (re-reading every token each step cost
0.17 / 1.0 / 4.1 ms a row at 256 / 2,048 / 8,192 output tokens, vocabulary 152k, on this
project's CPU). The pool holds 5 bytes a vocabulary entry for each live sequence that asks for a
penalty (0.76 MB at 152k). Elementwise over the vocabulary, the dense form gives each entry the
same arithmetic as the sparse one (tests/engine/test_logits_processing.py checks the bits against
a row-at-a-time, whole-token-list reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from corun.memory_plan import cuda_peak_bytes
from corun.sampler import Sampler, SamplingTensors, seed_to_int64
from corun.sequence import Sequence


@dataclass
class _PenaltyRow:
    row: int  # this sequence's row of the pool's tensors
    num_outputs: int = 0  # output tokens counted so far


class PenaltyPool:
    """What the penalties need of every live sequence that asks for one, a row each of two
    [capacity, V] tensors on the logits' device: ``prompt_seen`` marks its prompt's tokens and
    ``counts`` counts its output tokens (so the repetition penalty's "seen" is ``prompt_seen |
    counts > 0``). A step adds only the tokens appended since the last one, for every sequence in
    one scatter. A sequence's row is freed when it finishes (``release``, from the engine) and
    reused. The first use allocates ``initial_rows`` rows (the runner's max_num_seqs, which its
    memory profile counts); the pool doubles when it runs out (preempted sequences keep theirs)."""

    def __init__(self, device: torch.device | str, initial_rows: int = 8) -> None:
        self.device = torch.device(device)
        self.initial_rows = initial_rows
        self.vocab = 0
        self.prompt_seen = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        self.counts = torch.zeros(0, 0, dtype=torch.float32, device=self.device)
        self._rows: dict[int, _PenaltyRow] = {}
        self._free: list[int] = []

    @property
    def num_live(self) -> int:
        return len(self._rows)

    def release(self, seq_id: int) -> None:
        """Free a finished sequence's row (unknown ids are ignored)."""
        entry = self._rows.pop(seq_id, None)
        if entry is not None:
            self._free.append(entry.row)

    def _grow(self, vocab: int, needed: int) -> None:
        if vocab != self.vocab:
            if self._rows:
                raise ValueError(f"logits: vocabulary {vocab} where the pool holds {self.vocab}")
            self.vocab, self._free = vocab, []
            self.prompt_seen = self.prompt_seen.new_zeros(0, vocab)
            self.counts = self.counts.new_zeros(0, vocab)
        old = self.counts.shape[0]
        if len(self._free) >= needed:
            return
        capacity = max(2 * old, old + needed - len(self._free), self.initial_rows)
        self.prompt_seen = torch.cat([self.prompt_seen,
                                      self.prompt_seen.new_zeros(capacity - old, vocab)])
        self.counts = torch.cat([self.counts, self.counts.new_zeros(capacity - old, vocab)])
        self._free.extend(range(capacity - 1, old - 1, -1))  # lowest row first off the end

    def rows_of(self, seqs: list[Sequence], vocab: int) -> torch.Tensor:
        """The pool rows ([len(seqs)] int64) of ``seqs``, each brought up to its current output
        (a new row from its prompt once)."""
        self._grow(vocab, sum(seq.seq_id not in self._rows for seq in seqs))
        fresh: list[int] = []
        prompt_flat: list[int] = []
        output_flat: list[int] = []
        rows: list[int] = []
        for seq in seqs:
            entry = self._rows.get(seq.seq_id)
            if entry is None:
                entry = self._rows[seq.seq_id] = _PenaltyRow(self._free.pop())
                fresh.append(entry.row)
                base = entry.row * vocab
                prompt_flat.extend(base + t for t in seq.prompt_token_ids)
            new = seq.output_token_ids[entry.num_outputs:]
            if new:
                base = entry.row * vocab
                output_flat.extend(base + t for t in new)
                entry.num_outputs += len(new)
            rows.append(entry.row)
        device = self.device
        if fresh:  # a reused row still holds its last owner's tokens
            fresh_rows = torch.tensor(fresh, dtype=torch.int64, device=device)
            self.prompt_seen.index_fill_(0, fresh_rows, False)
            self.counts.index_fill_(0, fresh_rows, 0.0)
        if prompt_flat:
            self.prompt_seen.view(-1)[torch.tensor(prompt_flat, dtype=torch.int64,
                                                   device=device)] = True
        if output_flat:
            ids = torch.tensor(output_flat, dtype=torch.int64, device=device)
            # Whole counts in fp32: exact in any order of the accumulation.
            self.counts.view(-1).index_put_((ids,), torch.ones(len(ids), device=device),
                                            accumulate=True)
        return torch.tensor(rows, dtype=torch.int64, device=device)


def _groups(values: list) -> dict:
    """Indices of ``values`` by value (first-seen order)."""
    groups: dict = {}
    for i, value in enumerate(values):
        groups.setdefault(value, []).append(i)
    return groups


def _update_rows(out: torch.Tensor, index: list[int], fn) -> None:
    """``out[index] = fn(out[index])`` (the whole tensor in place when ``index`` is every row)."""
    if len(index) == out.shape[0]:
        out.copy_(fn(out))
        return
    rows = torch.tensor(index, dtype=torch.int64, device=out.device)
    out[rows] = fn(out[rows])


# Rows are processed in blocks of about BLOCK_BYTES of fp32 rows: on a GPU 32 MB, 55 rows at
# V = 152k, so a step's temporaries (a few [rows, V] fp32 tensors; the runner's memory profile
# counts them, profile_peak_bytes) stay small beside the KV cache while B = 128 rows with a
# repetition penalty take 55 ops, against 2,305 row by row. On the CPU 4 MB (6 rows at V = 152k,
# every row at a tiny model's vocabulary): there all the rows in one block ran slower than row
# by row at every B >= 8 (results/logits-processing-cpu.json), each op's temporary of B x V
# floats being mapped and page-faulted afresh (with glibc's mmap threshold raised, one block of
# 128 rows ran as fast as row by row).
BLOCK_BYTES = 32 << 20
CPU_BLOCK_BYTES = 4 << 20


def process_rows(logits: torch.Tensor, seqs: list[Sequence], pool: PenaltyPool,
                 block_bytes: int | None = None) -> torch.Tensor:
    """The processed copy ([R, V] fp32) of ``logits`` ([R, V], row i the raw logits of
    ``seqs[i]``'s next token).

    Every processor is an elementwise function of one row and that row's own request, applied
    to all the rows that ask for it at once: rows that share a parameter value are one launch
    with that value as the same Python scalar a row alone would get, so a row's bits are those
    of processing it by itself (the scalar matters on CUDA, where ``tensor / float`` multiplies by
    the float's reciprocal and ``tensor / tensor`` divides). ``block_bytes`` defaults to the
    device's (BLOCK_BYTES, CPU_BLOCK_BYTES on the CPU)."""
    if block_bytes is None:
        block_bytes = CPU_BLOCK_BYTES if logits.device.type == "cpu" else BLOCK_BYTES
    block = max(1, block_bytes // (4 * logits.shape[1]))
    if len(seqs) > block:
        return torch.cat([_process_block(logits[i:i + block], seqs[i:i + block], pool)
                          for i in range(0, len(seqs), block)])
    return _process_block(logits, seqs, pool)


def _process_block(logits: torch.Tensor, seqs: list[Sequence], pool: PenaltyPool) -> torch.Tensor:
    out = logits.to(torch.float32, copy=True)
    vocab = out.shape[1]
    device = out.device
    params = [seq.params for seq in seqs]
    guided = [i for i, seq in enumerate(seqs) if seq.guide is not None]
    if guided:  # the grammar's disallowed tokens can never come back
        allowed = torch.stack([seqs[i].guide.allowed_mask(vocab) for i in guided]).to(device)
        _update_rows(out, guided, lambda x: x.masked_fill(~allowed, float("-inf")))
    bias_ids, bias_values = [], []
    for i, p in enumerate(params):
        if p.logit_bias:  # keys are unique: no two writes to one entry
            # The engine refuses ids past the vocabulary at admission; on the flat view one
            # would land in the next row, so none is let through here either.
            items = [(t, b) for t, b in p.logit_bias.items() if t < vocab]
            bias_ids.extend(i * vocab + t for t, _ in items)
            bias_values.extend(b for _, b in items)
    flat = out.view(-1)
    if bias_ids:
        ids = torch.tensor(bias_ids, dtype=torch.int64, device=device)
        flat[ids] += torch.tensor(bias_values, dtype=torch.float32, device=device)
    masked = [i * vocab + t for i, seq in enumerate(seqs)
              if seq.num_output_tokens < seq.params.min_tokens
              for t in sorted(seq.min_tokens_masked_ids) if t < vocab]
    if masked:
        flat[torch.tensor(masked, dtype=torch.int64, device=device)] = float("-inf")
    penalized = [i for i, p in enumerate(params) if p.has_penalties]
    if penalized:
        pool_rows = pool.rows_of([seqs[i] for i in penalized], vocab)
        counts = pool.counts.index_select(0, pool_rows)  # [P, V], row j is seqs[penalized[j]]
        seen = pool.prompt_seen.index_select(0, pool_rows) | (counts > 0)
        repetition = _groups([params[i].repetition_penalty for i in penalized])
        for penalty, members in repetition.items():
            if penalty == 1.0:
                continue
            mask = _select(seen, members)
            _update_rows(out, [penalized[j] for j in members],
                         lambda x, m=mask, p=penalty: torch.where(
                             m, torch.where(x > 0, x / p, x * p), x))
        additive = _groups([(params[i].frequency_penalty, params[i].presence_penalty)
                            for i in penalized])
        for (frequency, presence), members in additive.items():
            if frequency == 0.0 and presence == 0.0:
                continue
            count = _select(counts, members)
            _update_rows(out, [penalized[j] for j in members],
                         lambda x, c=count, f=frequency, pr=presence: torch.where(
                             c > 0, x - (f * c + pr), x))
    floors = _groups([(p.temperature, p.min_p) if p.min_p > 0.0 and not p.is_greedy else None
                      for p in params])
    for key, members in floors.items():
        if key is None:
            continue
        temperature, min_p = key
        # p_i < min_p * p_max  <=>  (l_i - l_max) / T < log(min_p)
        offset = temperature * math.log(min_p)
        _update_rows(out, members, lambda x, o=offset: torch.where(
            x < x.amax(dim=-1, keepdim=True) + o, torch.full_like(x, float("-inf")), x))
    return out


def _select(tensor: torch.Tensor, members: list[int]) -> torch.Tensor:
    """Rows ``members`` of ``tensor`` (the tensor itself when that is every row)."""
    if len(members) == tensor.shape[0]:
        return tensor
    return tensor.index_select(0, torch.tensor(members, dtype=torch.int64,
                                               device=tensor.device))


def run_largest_step(sampler: Sampler, vocab: int, max_rows: int, device: torch.device,
                     max_logprobs: int = 0) -> PenaltyPool:
    """The largest per-request work after a step's forward, on ``max_rows`` rows: each asks for
    every processor, over a fresh pool of as many rows, and is re-sampled; then the top
    ``max_logprobs`` ids and their logprobs. The last row of every block has values of its own,
    so each block also copies its other rows out (what a mixed block allocates). Returns the
    pool."""
    from corun.sampling_params import SamplingParams

    shared = SamplingParams(temperature=1.0, repetition_penalty=1.1, frequency_penalty=0.1,
                            presence_penalty=0.1, min_p=0.01, logit_bias={0: 1.0}, max_tokens=1)
    odd = SamplingParams(temperature=0.5, repetition_penalty=1.2, frequency_penalty=0.2,
                         presence_penalty=0.2, min_p=0.02, logit_bias={0: 1.0}, max_tokens=1)
    block = max(1, BLOCK_BYTES // (4 * vocab))
    seqs = [Sequence(-1 - i, "profile", 0, [0], odd if i % block == block - 1 else shared, seed=0)
            for i in range(max_rows)]
    for seq in seqs:
        seq.append_token(1)
    logits = torch.zeros(max_rows, vocab, device=device)
    samples = torch.zeros(max_rows, 3, dtype=torch.int64, device=device)
    pool = PenaltyPool(device, max_rows)
    resample_processed(sampler, logits, samples, seqs, pool)
    if max_logprobs:  # as the runner's step (ModelRunner._result)
        sampler.logprobs_with_top(logits, samples[:, :1], max_logprobs)
    return pool


def profile_peak_bytes(sampler: Sampler, vocab: int, max_rows: int, device: torch.device,
                       max_logprobs: int = 0) -> int:
    """CUDA bytes the largest per-request work after a step's forward allocates
    (``run_largest_step``): the runner keeps them out of the KV cache's budget, as vLLM profiles
    its sampler with penalties and logprobs."""
    return cuda_peak_bytes(
        lambda: run_largest_step(sampler, vocab, max_rows, device, max_logprobs), device)


def resample_processed(sampler: Sampler, logits: torch.Tensor, samples: torch.Tensor,
                       seqs: list[Sequence], pool: PenaltyPool) -> torch.Tensor:
    """``samples`` ([R, 3]: token, digest) with the token of every row whose request processes
    its logits re-drawn from the processed row (same seed, sample index and position). Returns
    ``samples`` itself when no row asks for processing, else a new tensor."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.has_logits_processing]
    if not rows:
        return samples
    device = logits.device
    chosen = [seqs[i] for i in rows]
    row_index = torch.tensor(rows, dtype=torch.int64, device=device)
    raw = logits if len(rows) == logits.shape[0] else logits.index_select(0, row_index)
    processed = process_rows(raw, chosen, pool)
    params = [s.params for s in chosen]
    tensors = SamplingTensors(
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32,
                                 device=device),
        top_k=torch.tensor([p.effective_top_k for p in params], dtype=torch.int32, device=device),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        seeds=torch.tensor([seed_to_int64(s.seed) for s in chosen], dtype=torch.int64,
                           device=device),
        sample_indices=torch.tensor([s.sample_index for s in chosen], dtype=torch.int32,
                                    device=device),
        # The sampled token lands at index num_tokens: the position the step's sampler used.
        positions=torch.tensor([s.num_tokens for s in chosen], dtype=torch.int64, device=device),
        all_greedy=all(p.is_greedy for p in params))
    tokens = sampler.sample(processed, tensors)
    out = samples.clone()
    out[row_index, 0] = tokens.to(out.dtype)
    return out
