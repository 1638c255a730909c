"""Sequence: one sample of one request, as the scheduler and the engine track it.

A request with ``n`` samples becomes ``n`` sequences (sample indices 0..n-1) that share the
prompt, the params and the seed, and are prefilled separately (isolated prefill per sample). No
class-level mutable state: the block size lives in the block manager, not here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from corun.detokenizer import IncrementalText
from corun.fingerprint import Fingerprint
from corun.sampling_params import SamplingParams

if TYPE_CHECKING:
    from corun.grammar import SequenceGuide


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # admitted to the queue, no KV yet
    RUNNING = "running"  # KV on the device, scheduled for prefill or decode
    SWAPPED = "swapped"  # preempted: KV copied to host memory, blocks returned
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Token ids, cached-KV progress, block table and results of one sample.

    ``num_computed_tokens`` counts the tokens whose K/V are in the cache; a prefill step advances it
    by its chunk, a decode step by one. The next decode feeds ``token_ids[-1]`` at position
    ``num_tokens - 1``.
    """

    seq_id: int
    request_id: str
    sample_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[float] = field(default_factory=list)
    # Per step, the most likely tokens' logprobs (params.logprobs of them), most likely first.
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    # params.prompt_logprobs: per prompt position, None first, then the prompt token's and the
    # top-N tokens' logprobs; set when the prompt's prefill finished.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Beside it, per position the prompt token's rank in the whole vocabulary (None first), and
    # the (d1, d2) digest of the logits row that predicts it (a fingerprint's integers).
    prompt_token_ranks: list[int | None] | None = None
    prompt_logits_digests: list[tuple[int, int] | None] | None = None
    # Routing replay (EngineConfig.enable_return_routed_experts): set when it finishes.
    routed_experts: object | None = None
    # EOS (even with ignore_eos, as vLLM) and the stop ids: masked while fewer than min_tokens
    # were generated.
    min_tokens_masked_ids: frozenset[int] = frozenset()
    fingerprint: Fingerprint = field(default_factory=Fingerprint)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_reported_tokens: int = 0  # output tokens already handed out as deltas
    num_reported_chars: int = 0  # output text already handed out as deltas
    num_preemptions: int = 0
    stop_text_len: int | None = None  # output text is cut here when a stop string matched
    # Output text the stop strings were matched against (a new match must end past it).
    stop_checked_chars: int = 0
    # The engine's decode of the output tokens (``LLMEngine._output_text``): once a step, the
    # tokens of a moving window (corun.detokenizer).
    detokenized: IncrementalText = field(default_factory=IncrementalText)
    # The generated tokens, appended in step with token_ids: outputs hand this list out without
    # copying it every step (a finished sequence's list no longer changes).
    output_ids: list[int] = field(default_factory=list)
    # time.perf_counter() when each output token was committed (the server's inter-token
    # latencies of a request it sees only finished: corun.api.responses).
    token_times: list[float] = field(default_factory=list)
    # Prefix cache: chained hashes of the full prompt blocks (computed on first lookup), and how
    # many leading blocks of block_table are cached ones (taken on a hit or registered after
    # their prefill; ``corun.kv_cache``).
    block_hashes: list[bytes] | None = None
    num_cached_blocks: int = 0
    # Structured output: this sample's own position in the request's grammar (corun.grammar),
    # advanced by each of its tokens; None without params.structured.
    guide: SequenceGuide | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    # -- lengths -------------------------------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.output_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than the last token is missing from the cache: the next step is a prefill chunk."""
        return self.num_uncomputed_tokens > 1 or self.num_output_tokens == 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        token_id = int(token_id)
        self.token_ids.append(token_id)
        self.output_ids.append(token_id)
