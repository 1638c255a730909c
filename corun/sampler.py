"""Sampler: request-bound sampling over the logits rows of one step.

Each row's token is a pure function of that row's logits and of its request's
``(seed, sample index, position)``: the noise is Philox keyed by the request seed with the
counter (vocab index, position, sample index), never a global generator
(``kernels.sampling_reference.sampling_uniform_reference``). So a request samples the same
tokens whatever rows sit beside it, and the ``n`` samples of one request differ (their sample
indices differ).

Backends: ``kernels.sampling.sample`` / ``token_logprobs`` on ``triton``; the reference
(``sample_reference``, ``log_softmax``) on ``torch``, with the same numerics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.sampling_reference import sample_reference


def seed_to_int64(seed: int) -> int:
    """A seed in [-2**63, 2**64) as the int64 with its 64-bit two's-complement bits (the Philox
    key words survive; a negative seed is already that int64)."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


@dataclass
class SamplingTensors:
    """Per-row sampling inputs of one step, on the device: views of the runner's static step
    buffers (``corun.step_inputs``), filled once per step with the rest of the step's inputs."""

    temperature: torch.Tensor  # [N] f32, 0 = greedy
    top_k: torch.Tensor  # [N] int32, <= 0 = off
    top_p: torch.Tensor  # [N] f32
    seeds: torch.Tensor  # [N] int64
    sample_indices: torch.Tensor  # [N] int32
    positions: torch.Tensor  # [N] int64, absolute position of the token being sampled
    all_greedy: bool = False  # host flag: the torch backend's argmax shortcut
    want_logprobs: bool = False


class Sampler:
    def __init__(self, backend: str, device: torch.device) -> None:
        self.backend = backend
        self.device = device

    def sample(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """logits [N, V] fp32 -> token ids [N] int64."""
        if self.backend == "triton":
            from kernels.sampling import sample

            return sample(logits, t.temperature, t.top_k, t.top_p, t.seeds, t.sample_indices,
                          t.positions)
        if t.all_greedy:
            # Exactly sample_reference's greedy branch (argmax, first index on ties), without its
            # per-row top-k/top-p mask loop.
            return logits.argmax(dim=1)
        return sample_reference(logits, t.temperature, t.top_k, t.top_p, t.seeds,
                                t.sample_indices, t.positions)

    def logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Log-probabilities under softmax(logits) (no temperature) of each row's ids: [N] for
        ids [N], [N, K] for ids [N, K] (a row's ids share one log-softmax of that row)."""
        if self.backend == "triton":
            from kernels.sampling import token_logprobs

            return token_logprobs(logits, token_ids)
        logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
        if token_ids.ndim == 2:
            return logp.gather(1, token_ids.long())
        return logp.gather(1, token_ids.view(-1, 1).long()).view(-1)

    def logprobs_with_top(self, logits: torch.Tensor, first_ids: torch.Tensor,
                          top_n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, logprobs), each [N, 1 + top_n]: each row's own id ([N, 1]: the sampled token,
        or the prompt token it predicts) first, then the row's ``top_n`` most likely ids
        (``top_token_ids``), with their logprobs."""
        ids = first_ids
        if top_n:
            ids = torch.cat([ids, top_token_ids(logits, top_n)], dim=1)
        return ids, self.logprobs(logits, ids)


# top_token_ids builds its int64 keys a block of rows at a time: all 128 rows at V = 152k at once
# held up to three [128, V] int64 temporaries (156 MB each) beside the KV cache.
TOP_IDS_BLOCK_BYTES = 32 << 20


def top_token_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of each row's ``k`` largest logits, most likely first, lowest id first on ties:
    [N, k] int64.

    Exact and per row: each logit becomes a unique int64 key (its fp32 bits in an order-preserving
    signed form, shifted up, and the reversed vocab index below), so the top-k set and its order are
    defined by the row's bits alone whatever algorithm ``topk`` runs and whatever rows sit beside
    it (on float values ``topk`` may order ties differently between runs or batch sizes), and the
    rows may go through in blocks (``TOP_IDS_BLOCK_BYTES`` of keys each).
    """
    if k <= 0:
        return torch.empty(logits.shape[0], 0, dtype=torch.int64, device=logits.device)
    vocab = logits.shape[1]
    block = max(1, TOP_IDS_BLOCK_BYTES // (8 * vocab))
    if logits.shape[0] > block:
        return torch.cat([top_token_ids(logits[i:i + block], k)
                          for i in range(0, logits.shape[0], block)])
    # + 0.0 turns -0.0 into +0.0: equal logits must get equal value keys.
    bits = (logits.to(torch.float32) + 0.0).contiguous().view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    reversed_index = torch.arange(vocab - 1, -1, -1, dtype=torch.int64, device=logits.device)
    keys = ordered * (1 << 32) + reversed_index
    return keys.topk(min(k, vocab), dim=1).indices
