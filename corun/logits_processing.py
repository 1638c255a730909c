"""Per-request logits processing before sampling: grammar mask, logit bias, min_tokens, penalties,
min_p.

Each processed row is a function of that row's raw logits and of its own request's params and
tokens only (the structured-output mask first, then vLLM's order: ``logit_bias`` and
``min_tokens``, then the repetition, frequency and presence penalties, then ``min_p`` against the
temperature-scaled distribution), applied to a copy
of the row one row at a time; the row is then sampled by the same sampler with the same
per-request noise. So a processed request's tokens do not depend on what runs beside it, and the
rows that ask for nothing are neither touched nor re-sampled (their bits are the step's).

The raw logits stay as they were: the logits digest and the reported logprobs are of the model's
output (vLLM's default ``raw_logprobs``).

The penalties read a sequence's tokens through ``PenaltyState``, dense per-vocabulary tensors on
the logits' device that follow the sequence: a step adds only the tokens appended since the last
one, so a row's work does not grow with the output. Re-reading every token each step (the form
before) cost 0.17 / 1.0 / 4.1 ms a row at 256 / 2,048 / 8,192 output tokens, vocabulary 152k, on
this project's CPU; the dense form costs 0.5-0.6 ms a row there at every length, its passes over
the vocabulary (a GPU's are not measured yet). The state holds 5 bytes a vocabulary entry for
each sequence that asks for a penalty (0.76 MB at 152k). Elementwise over the vocabulary, the
dense form gives each entry the same arithmetic as the sparse one
(tests/engine/test_logits_processing.py checks the bits against it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from corun.sampler import Sampler, SamplingTensors, seed_to_int64
from corun.sequence import Sequence


@dataclass
class PenaltyState:
    """What the penalties need of one sequence's tokens, kept up to date step by step:
    ``seen`` [V] bool, the tokens of its prompt and output (repetition penalty), and
    ``counts`` [V] fp32, how often each token appears in its output (frequency and presence),
    covering the first ``num_outputs`` output tokens."""

    seen: torch.Tensor
    counts: torch.Tensor
    num_outputs: int = 0

    @classmethod
    def of(cls, seq: Sequence, vocab: int, device: torch.device) -> PenaltyState:
        """``seq``'s state on ``device``, brought up to its current output (built on first use,
        from the prompt once)."""
        state = seq.penalty_state
        if state is None or state.counts.device != device or state.counts.shape[0] != vocab:
            state = cls(torch.zeros(vocab, dtype=torch.bool, device=device),
                        torch.zeros(vocab, dtype=torch.float32, device=device))
            state.seen[torch.tensor(seq.prompt_token_ids, dtype=torch.int64, device=device)] = True
            seq.penalty_state = state
        new = seq.output_token_ids[state.num_outputs:]
        if new:
            ids = torch.tensor(new, dtype=torch.int64, device=device)
            state.counts.index_put_((ids,), torch.ones(len(new), device=device), accumulate=True)
            state.seen[ids] = True
            state.num_outputs += len(new)
        return state


def process_row(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The processed copy of ``row`` ([V] fp32, raw logits of ``seq``'s next token)."""
    params = seq.params
    out = row.to(torch.float32).clone()
    device = out.device
    vocab = out.shape[0]
    if seq.guide is not None:  # the grammar's disallowed tokens can never come back
        allowed = seq.guide.allowed_mask(vocab).to(device)
        out = out.masked_fill(~allowed, float("-inf"))
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.int64, device=device)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
        out[ids] += bias  # keys are unique: no two writes to one token
    if seq.num_output_tokens < params.min_tokens and seq.min_tokens_masked_ids:
        ids = torch.tensor(sorted(seq.min_tokens_masked_ids), dtype=torch.int64, device=device)
        out[ids[ids < vocab]] = float("-inf")
    frequency_or_presence = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
    if params.repetition_penalty != 1.0 or frequency_or_presence:
        state = PenaltyState.of(seq, vocab, device)
    if params.repetition_penalty != 1.0:
        penalty = params.repetition_penalty
        out = torch.where(state.seen, torch.where(out > 0, out / penalty, out * penalty), out)
    if frequency_or_presence and seq.num_output_tokens:
        present = state.counts > 0
        out = torch.where(
            present, out - (params.frequency_penalty * state.counts + params.presence_penalty),
            out)
    if params.min_p > 0.0 and not params.is_greedy:
        # p_i < min_p * p_max  <=>  (l_i - l_max) / T < log(min_p)
        floor = out.max() + params.temperature * math.log(params.min_p)
        out = torch.where(out < floor, torch.full_like(out, float("-inf")), out)
    return out


def resample_processed(sampler: Sampler, logits: torch.Tensor, samples: torch.Tensor,
                       seqs: list[Sequence]) -> torch.Tensor:
    """``samples`` ([R, 3]: token, digest) with the token of every row whose request processes
    its logits re-drawn from the processed row (same seed, sample index and position). Returns
    ``samples`` itself when no row asks for processing, else a new tensor."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.has_logits_processing]
    if not rows:
        return samples
    device = logits.device
    processed = torch.stack([process_row(logits[i], seqs[i]) for i in rows])
    chosen = [seqs[i] for i in rows]
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
    out[torch.tensor(rows, dtype=torch.int64, device=device), 0] = tokens.to(out.dtype)
    return out
