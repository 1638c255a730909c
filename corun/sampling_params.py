"""SamplingParams: how one request samples and when it stops (vLLM-shaped, validated up front).

Every invalid field raises ``ValueError`` naming it at construction, before the request reaches the
engine, so a bad request never disturbs the ones in flight.

The seed binds the sampling noise to the request: token ``t`` of sample ``i`` draws its noise from
Philox keyed by ``(seed, i, position of t)`` only
(``kernels.reference.sampling_uniform_reference``), so the same request with the same seed
samples the same tokens whatever runs beside it. Without a seed the engine draws one at admission
(from the OS, not from any global generator) and reports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_SEED = 2**64  # seeds are 64-bit unsigned keys of the Philox generator


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping.

    - ``n``: independent samples of the prompt (sample indices 0..n-1, same seed).
    - ``temperature``: 0 = greedy (argmax, lowest id on ties); > 0 = Gumbel-max sampling.
    - ``top_p`` in (0, 1] (1 = off); ``top_k``: 0 or -1 = off, else keep the k most likely.
    - ``max_tokens``: output tokens at most (>= 1); generation also stops at max_model_len.
    - ``seed``: int in [0, 2**64) or None (drawn at admission and reported back).
    - ``stop``: strings that end generation (needs a tokenizer); ``stop_token_ids``: ids that do;
      ``ignore_eos``: keep going past EOS (benchmarks).
    - ``logprobs``: None, or an int >= 0: return the sampled token's log-probability (under the
      untempered softmax) per step; top-N alternatives are not returned.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n: expected an int >= 1, got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise ValueError(f"temperature: expected a finite float >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) \
                or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: expected a float in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k: expected an int >= -1 (0 or -1 = off), got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise ValueError(f"seed: expected an int in [0, 2**64) or None, got {self.seed!r}")
        stop = self.stop
        if stop is not None:
            items = [stop] if isinstance(stop, str) else list(stop)
            if not all(isinstance(s, str) and s for s in items):
                raise ValueError(f"stop: expected non-empty strings, got {stop!r}")
        if self.stop_token_ids is not None:
            if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
                raise ValueError(
                    f"stop_token_ids: expected non-negative ints, got {self.stop_token_ids!r}"
                )
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs: expected None or an int >= 0, got {self.logprobs!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def stop_token_set(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids or ())

    @property
    def effective_top_k(self) -> int:
        """The sampler's convention: <= 0 disables top-k."""
        return 0 if self.top_k in (0, -1) else self.top_k
