"""What the engine hands back: per request, one CompletionOutput per sample (vLLM-shaped).

``LLMEngine.step`` returns a ``RequestOutput`` for every request that gained tokens or finished in
that step: cumulative ``token_ids`` and the ``delta_token_ids`` since the previous output; the
``fingerprint`` (``corun.fingerprint``) once a sample has finished. Convenience properties on
``RequestOutput`` read sample 0, the common ``n = 1`` case.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REPLACEMENT_CHAR = "\ufffd"  # a decoder's stand-in for an incomplete UTF-8 sequence


def settled_text(text: str, stop_strings: tuple[str, ...], include_stop_str: bool) -> str:
    """The part of an unfinished output's text no later token can take back (vLLM's hold-back):
    without trailing U+FFFD (the first bytes of a character the next token completes), then
    without the last ``max(len(stop)) - 1`` characters of the rest while stop strings are set
    and cut away (they may begin a stop string, whose last character may be the one still
    incomplete)."""
    text = text.rstrip(REPLACEMENT_CHAR)
    if stop_strings and not include_stop_str:
        text = text[:max(len(text) - (max(map(len, stop_strings)) - 1), 0)]
    return text


@dataclass
class CompletionOutput:
    index: int  # sample index, 0..n-1
    token_ids: list[int]
    delta_token_ids: list[int]
    # When the engine has a tokenizer: the text so far (cut at a stop once finished; while
    # unfinished, only its ``settled_text``), and what it added since the previous output.
    text: str | None = None
    delta_text: str | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string, if any
    fingerprint: str | None = None  # hex sha256, set when the sample finished
    logprobs: list[float] | None = None  # sampled token's log-probability per step
    # Per step, {token id: logprob} of the params.logprobs most likely tokens, most likely first.
    top_logprobs: list[dict[int, float]] | None = None
    num_preemptions: int = 0
    # EngineConfig.enable_return_routed_experts, once finished: numpy int [tokens, MoE layers, k],
    # the experts each MoE layer routed each token the model read to (the prompt and every
    # sampled token but the last), in rank order.
    routed_experts: object | None = field(default=None, repr=False)
    # time.perf_counter() at each token's commit (the live list, as token_ids).
    token_times: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else float(sum(self.logprobs))


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None  # earliest first token over the samples
    finish_time: float | None = None  # when the last sample finished
    num_output_tokens: int = 0  # the longest sample's

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    seed: int
    prompt: str | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # params.prompt_logprobs: None for the first prompt token, then per position {token id:
    # logprob} of the top-N tokens and of the prompt token (vLLM's prompt_logprobs).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Beside it, per position the prompt token's rank: the number of vocabulary entries with a
    # logprob at least its own (ties included, as vLLM V1), even outside the top-N (None first).
    prompt_token_ranks: list[int | None] | None = None
    # And the (d1, d2) digest of the logits row behind each position (None first): the integers
    # a sampled token's fingerprint hashes (corun.fingerprint), so a scored sequence can be
    # fingerprinted as if it had been sampled (``LLM.score``).
    prompt_logits_digests: list[tuple[int, int] | None] | None = field(default=None, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    # Sample 0, for the n = 1 case.
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def delta_token_ids(self) -> list[int]:
        return self.outputs[0].delta_token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def fingerprint(self) -> str | None:
        return self.outputs[0].fingerprint

    @property
    def logprobs(self) -> list[float] | None:
        return self.outputs[0].logprobs


@dataclass
class ScoreOutput:
    """``LLM.score``'s result for one sequence: the completion tokens scored by teacher forcing
    given the prompt (vLLM-style per-token logprobs, as a generated sample reports them).

    ``logprobs[i]`` is completion token i's log-probability (softmax of the raw logits, no
    temperature), ``top_logprobs[i]`` ({token id: logprob} of the N most likely, most likely
    first, when asked for) and ``fingerprint`` the sha256 a sample with exactly these tokens
    carries (``CompletionOutput.fingerprint``). Under path invariance (``EngineConfig``) all
    three have the bits the engine gave the same tokens when it sampled them."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None
    fingerprint: str
