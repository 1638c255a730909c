"""SamplingParams: how one request samples and when it stops (vLLM-shaped, validated up front).

Every invalid field raises ``ValueError`` naming it at construction, before the request reaches the
engine, so a bad request never disturbs the ones in flight.

The seed binds the sampling noise to the request: token ``t`` of sample ``i`` draws its noise from
Philox keyed by ``(seed, i, position of t)`` only
(``kernels.sampling_reference.sampling_uniform_reference``), so the same request with the same seed
samples the same tokens whatever runs beside it. Without a seed the engine draws one at admission
(from the OS, not from any global generator) and reports it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corun.structured_output import StructuredOutput

MAX_SEED = 2**64  # seeds are 64-bit unsigned keys of the Philox generator
# vLLM takes any int64 too (its protocol's seed bound): a negative seed is the key with the same
# two's-complement bits, so seed -1 samples as 2**64 - 1 does.
MIN_SEED = -(2**63)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite int or float (not a bool)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and value == value and abs(value) != float("inf"))


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping.

    - ``n``: independent samples of the prompt (sample indices 0..n-1, same seed).
    - ``temperature``: 0 = greedy (argmax, lowest id on ties); > 0 = Gumbel-max sampling.
    - ``top_p`` in (0, 1] (1 = off); ``top_k``: 0 or -1 = off, else keep the k most likely.
    - ``max_tokens``: output tokens at most (>= 0; 0 scores the prompt and generates nothing, with
      ``prompt_logprobs``); generation also stops at max_model_len.
    - ``seed``: int in [-2**63, 2**64) or None (drawn at admission and reported back); a
      negative seed keys Philox with its 64-bit two's complement.
    - ``stop``: strings that end generation (needs a tokenizer); ``stop_token_ids``: ids that do;
      ``ignore_eos``: keep going past EOS (benchmarks). As in vLLM, the tokenizer's own EOS ends
      a sample with ``stop_reason`` None, the other EOS ids (generation_config.json's) and the
      stop ids with the id.
    - ``logprobs``: None, or an int N >= 0: per step the sampled token's log-probability and the
      N most likely tokens' (lowest id first on ties), under the softmax of the model's raw logits
      (before temperature, penalties and bias, as vLLM's default ``raw_logprobs``).
    - ``prompt_logprobs``: None, or an int N >= 0: per prompt position after the first, the prompt
      token's log-probability and the N most likely tokens' (sample 0 only).
    - ``presence_penalty`` / ``frequency_penalty`` in [-2, 2]: subtracted from the logit of each
      token already generated, once / once per occurrence; ``repetition_penalty`` > 0: the logit
      of each token of the prompt or the output is divided by it when positive, multiplied when
      not (1 = off); ``logit_bias``: token id -> bias in [-100, 100] added to its logit;
      ``min_tokens``: EOS (even with ``ignore_eos``, as vLLM) and the stop ids are masked until
      that many tokens were generated;
      ``min_p`` in [0, 1]: tokens less likely than ``min_p`` times the most likely one (after
      temperature) are masked. All act on the row's own logits and the request's own tokens.
    - ``best_of`` >= n: sample ``best_of`` sequences and return the ``n`` with the highest
      cumulative logprob (ties: lowest sample index); None = n.
    - ``structured``: a ``StructuredOutput`` (JSON schema, any JSON object, regex or choice) the
      output must match: every token the grammar does not allow is masked before the other
      processors run, and the output ends (EOS, "stop") when the match is complete. Not with
      ``ignore_eos`` or ``min_tokens`` (both would force tokens past the end of the match).
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
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    min_p: float = 0.0
    best_of: int | None = None
    structured: StructuredOutput | None = None
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
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"max_tokens: expected an int >= 0, got {self.max_tokens!r}")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not MIN_SEED <= self.seed < MAX_SEED):
            raise ValueError(f"seed: expected an int in [-2**63, 2**64) or None, "
                             f"got {self.seed!r}")
        stop = self.stop
        if stop is not None:
            items = [stop] if isinstance(stop, str) else stop
            if not isinstance(items, (list, tuple)) or not all(
                    isinstance(s, str) and s for s in items):
                raise ValueError(f"stop: expected a non-empty string or a list of them, "
                                 f"got {stop!r}")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                    _is_int(t) and t >= 0 for t in self.stop_token_ids):
                raise ValueError(
                    f"stop_token_ids: expected non-negative ints, got {self.stop_token_ids!r}"
                )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs: expected None or an int >= 0, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs: expected None or an int >= 0, "
                             f"got {self.prompt_logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}: expected a float in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(f"repetition_penalty: expected a float in (0, 100], "
                             f"got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_int(t) and t >= 0 and _is_number(b) and -100.0 <= b <= 100.0
                    for t, b in self.logit_bias.items()):
                raise ValueError(f"logit_bias: expected token id -> float in [-100, 100], "
                                 f"got {self.logit_bias!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens: expected an int >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} exceeds max_tokens "
                             f"{self.max_tokens}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: expected a float in [0, 1], got {self.min_p!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise ValueError(f"best_of: expected None or an int >= n ({self.n}), "
                             f"got {self.best_of!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise ValueError(f"structured: expected a StructuredOutput or None, "
                                 f"got {type(self.structured).__name__}")
            # Both would force tokens the grammar may not allow (EOS is its only way out).
            if self.ignore_eos:
                raise ValueError(f"ignore_eos: not supported with structured output "
                                 f"({self.structured.field})")
            if self.min_tokens > 0:
                raise ValueError(f"min_tokens: not supported with structured output "
                                 f"({self.structured.field})")

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
    def num_samples(self) -> int:
        """Sequences the engine runs: ``best_of`` when set, else ``n``."""
        return self.n if self.best_of is None else self.best_of

    @property
    def needs_logprobs(self) -> bool:
        """The sampled tokens' logprobs are needed: asked for, or to rank ``best_of``."""
        return self.logprobs is not None or self.num_samples > self.n

    @property
    def has_penalties(self) -> bool:
        """A repetition, frequency or presence penalty is set (they read the sequence's
        tokens: ``corun.logits_processing.PenaltyPool``)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def has_logits_processing(self) -> bool:
        """Some field changes the logits before sampling (``corun.logits_processing``)."""
        return (self.has_penalties or bool(self.logit_bias)
                or self.min_tokens > 0 or (self.min_p > 0.0 and not self.is_greedy)
                or self.structured is not None)

    @property
    def effective_top_k(self) -> int:
        """The sampler's convention: <= 0 disables top-k."""
        return 0 if self.top_k in (0, -1) else self.top_k


# generation_config.json keys vLLM applies as a request's defaults, and the field each sets.
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                            "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                            "max_new_tokens": "max_tokens"}


def generation_defaults_of(source: str, model: str | None) -> dict[str, Any]:
    """The sampling defaults a ``generation_config`` source names (vLLM's argument, the
    server's ``--generation-config``): "auto" = ``model``'s folder's file (none for a named
    config), "vllm" = none, or a folder holding one. ValueError for another source or a bad
    file."""
    if source == "vllm":
        return {}
    if source != "auto" and not Path(source).is_dir():
        raise ValueError(f"generation_config: expected 'auto', 'vllm' or a folder, got "
                         f"{source!r}")
    folder = model if source == "auto" else source
    if folder is None or not Path(folder).is_dir():
        return {}
    return generation_config_defaults(folder)


def generation_config_defaults(folder: str | Path) -> dict[str, Any]:
    """The sampling defaults a model's ``generation_config.json`` sets (vLLM's
    ``--generation-config auto``): ``GENERATION_CONFIG_FIELDS`` by their SamplingParams name;
    {} without the file. ValueError naming the key for a value SamplingParams refuses."""
    path = Path(folder, "generation_config.json")
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"generation_config: {path} is not readable JSON ({exc})") from None
    defaults = {field: data[key] for key, field in GENERATION_CONFIG_FIELDS.items()
                if data.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"generation_config: {path}: {exc}") from None
    return defaults
