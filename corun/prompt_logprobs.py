"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the final hidden rows of a prompt are kept
as its prefill chunks run, and once its prefill is done the LM head scores every position.

Prompt logprobs run the LM head over a prompt's rows in tiles of ``PROMPT_LOGPROBS_TILE`` rows,
tile t holding prompt positions [16 t, 16 t + 16) (the last one zero-padded): the GEMM's shape and
a row's place in it depend on the prompt alone, never on how it was chunked or on other
requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from corun.sampler import Sampler
from corun.step import StepPart
from corun.step_inputs import StepHost

PROMPT_LOGPROBS_TILE = 16


@dataclass
class PromptScores:
    """One prompt's scores, per position (None for the first, which nothing predicts):
    ``logprobs`` {token: logprob} of the top-N tokens (most likely first) and of the prompt token
    (last, when not among them); ``ranks`` the prompt token's rank in the vocabulary;
    ``digests`` the (d1, d2) logits digest of the row that predicts it, the integers a sampled
    token's fingerprint hashes (``corun.fingerprint``)."""

    logprobs: list[dict[int, float] | None]
    ranks: list[int | None]
    digests: list[tuple[int, int] | None]


class PromptScorer:
    """Keeps, per sequence id, the final hidden rows of a prompt being prefilled that wants
    prompt logprobs, and scores the prompt when its prefill is done. ``compute_logits`` maps
    final hidden rows [N, H] to fp32 logits [N, V] (the model's LM head), ``digest`` fp32
    logits [N, V] to their [N, 2] int64 digests (the step's ``LogitsDigest``)."""

    def __init__(self, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                 sampler: Sampler, digest: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.compute_logits = compute_logits
        self.sampler = sampler
        self.digest = digest
        self._hidden: dict[int, list[torch.Tensor]] = {}

    def drop(self, seq_id: int) -> None:
        """Forget a finished or aborted sequence's kept rows."""
        self._hidden.pop(seq_id, None)

    def clear(self) -> None:
        self._hidden.clear()

    def collect(self, part: StepPart, host: StepHost,
                hidden: torch.Tensor) -> dict[int, PromptScores]:
        """Keep the hidden rows of each prompt-logprob chunk; score each prompt whose prefill
        this part finished."""
        out = {}
        for chunk in part.chunks:
            seq = chunk.seq
            rows = host.prefill_rows.get((seq.seq_id, chunk.start))
            if rows is None:
                continue
            if chunk.start == 0:  # a prefill that starts (again, after a preemption)
                self._hidden[seq.seq_id] = []
            self._hidden[seq.seq_id].append(hidden[rows[0]:rows[1]].clone())
            if chunk.end >= seq.num_prompt_tokens:
                prompt_hidden = torch.cat(self._hidden.pop(seq.seq_id))
                out[seq.seq_id] = self.score(prompt_hidden, seq.prompt_token_ids,
                                             seq.params.prompt_logprobs)
        return out

    @torch.inference_mode()
    def score(self, hidden: torch.Tensor, prompt_ids: list[int], top_n: int) -> PromptScores:
        """``PromptScores`` of a prompt from its final hidden rows [L, H] (row i predicts token
        i + 1). A rank is the number of vocabulary entries with a logprob at least the prompt
        token's, itself and ties included (vLLM V1's ``batched_count_greater_than``), wherever
        it stands."""
        out: list[dict[int, float] | None] = [None]
        ranks: list[int | None] = [None]
        digests: list[tuple[int, int] | None] = [None]
        tile = PROMPT_LOGPROBS_TILE
        num_rows = len(prompt_ids) - 1
        padded = -(-num_rows // tile) * tile
        targets = torch.tensor(prompt_ids[1:] + [0] * (padded - num_rows), dtype=torch.int64,
                               device=hidden.device).view(-1, 1)
        hidden = hidden[:num_rows]
        if padded > num_rows:
            hidden = torch.cat([hidden, hidden.new_zeros(padded - num_rows, hidden.shape[1])])
        for start in range(0, padded, tile):
            logits = self.compute_logits(hidden[start:start + tile])
            tile_targets = targets[start:start + tile]
            ids, lps = self.sampler.logprobs_with_top(logits, tile_targets, top_n)
            # Counted on one full-vocabulary log-softmax, as vLLM counts: the sampler's
            # logprobs may differ from it in the last bit, which would miscount ties.
            logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
            # vLLM V1's batched_count_greater_than: the entries at or above the prompt token's
            # logprob, itself and every tie included.
            rank = (logp >= logp.gather(1, tile_targets)).sum(dim=1)
            real = min(tile, num_rows - start)
            for id_row, lp_row in zip(ids[:real].tolist(), lps[:real].tolist(), strict=True):
                entry = dict(zip(id_row[1:], lp_row[1:], strict=True))  # top-N, most likely first
                entry.setdefault(id_row[0], lp_row[0])  # then the prompt token, if not among them
                out.append(entry)
            ranks.extend(rank[:real].tolist())
            digests.extend(map(tuple, self.digest(logits)[:real].tolist()))
        return PromptScores(out, ranks, digests)
