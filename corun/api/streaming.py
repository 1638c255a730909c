"""Per-choice bookkeeping of a generation: incremental text, logprobs, timings; SSE framing.

Text is always derived from the token ids with the model's tokenizer, so a streamed response's
deltas concatenate to exactly the text a non-streamed response returns. The engine's outputs
carry that text, cut at a stop once finished and held back while unfinished
(``corun.outputs.settled_text``):

- while the decoded text ends in U+FFFD (the last token may be the first bytes of a multi-byte
  character, which the next token completes);
- while stop strings are set and cut away, its last ``max(len(stop)) - 1`` characters (they
  may be the start of a stop string, which must not reach the client).

Outputs without text are decoded here the same way, and cut before the stop string that
ended them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from corun.outputs import settled_text


def sse(payload: BaseModel | dict | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json(exclude_none=False)
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class ChoiceState:
    """One choice (prompt p, sample i) of a response, updated from each engine output."""

    index: int
    prompt_len: int
    decode: Any  # Callable[[list[int]], str]
    stop_strings: tuple[str, ...] = ()
    include_stop_str: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    # The request's prompt logprobs (echo with logprobs): None first, then {token id: logprob}.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ranks: list[int | None] | None = None  # beside it: the prompt token's rank
    text: str = ""  # the text so far: cut at a stop once finished, settled while unfinished
    sent_text_len: int = 0  # characters already handed out as deltas
    sent_token_len: int = 0  # token ids already handed out
    sent_logprob_len: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    fingerprint: str | None = None
    seed: int | None = None
    # The engine's routed experts of the finished sample (enable_return_routed_experts).
    routed_experts: list | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    _source: Any = field(default=None, repr=False)  # the live token list the lists copy from

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def update(self, output: Any, seed: int, prompt_logprobs: list | None = None,
               prompt_token_ranks: list | None = None) -> list[float]:
        """Take one ``CompletionOutput`` (and its request's prompt logprobs and prompt token
        ranks); returns the inter-token gaps it adds (for metrics)."""
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs
            self.prompt_token_ranks = prompt_token_ranks
        now = time.monotonic()
        gaps = []
        # The engine thread appends to these live lists (a token, then its logprob, then its
        # top-N) while this reads them: the shortest is a prefix every list holds (lengths only
        # grow), so the choice never sees a token without its logprobs.
        lists = [x for x in (output.token_ids, output.logprobs,
                             getattr(output, "top_logprobs", None)) if x is not None]
        count = min(len(x) for x in lists)
        if output.token_ids is not self._source or count < len(self.token_ids):
            # Another sample's lists (or fewer tokens): start over from them.
            self._source = output.token_ids
            self.token_ids, self.logprobs, self.top_logprobs = [], [], []
        new_tokens = count - len(self.token_ids)
        if new_tokens > 0:
            if self.first_token_time is None:
                self.first_token_time = now
            elif self.last_token_time is not None:
                gaps = [(now - self.last_token_time) / new_tokens] * new_tokens
            self.last_token_time = now
        # The lists only grow: copy what is new, not the whole output again (an update per step
        # would otherwise copy O(n) for each of n tokens).
        self.token_ids.extend(output.token_ids[len(self.token_ids):count])
        if output.logprobs is not None:
            self.logprobs.extend(output.logprobs[len(self.logprobs):count])
        if getattr(output, "top_logprobs", None) is not None:
            self.top_logprobs.extend(output.top_logprobs[len(self.top_logprobs):count])
        self.seed = seed
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason
            self.stop_reason = output.stop_reason
            self.fingerprint = output.fingerprint
            routed = getattr(output, "routed_experts", None)
            self.routed_experts = None if routed is None else routed.tolist()
        if output.text is not None:  # the engine's own detokenization, cut and settled
            self.text = output.text
            return gaps
        self.text = self.decode(self.token_ids)
        if not self.finished:
            self.text = settled_text(self.text, self.stop_strings, self.include_stop_str)
        elif isinstance(self.stop_reason, str) and not self.include_stop_str:
            # The stop string ends in text not sent yet, and the held-back text was long enough
            # to hold its start: it begins at or after what was sent.
            cut = self.text.find(self.stop_reason, self.sent_text_len)
            if cut >= 0:
                self.text = self.text[:cut]
        return gaps

    def take_delta(self) -> tuple[str, list[int], list[tuple[float, dict[int, float]]]]:
        """Text, token ids and logprobs not handed out yet (text held back as described above):
        per token its logprob and the {id: logprob} of the most likely tokens."""
        end = max(len(self.text), self.sent_text_len)
        text = self.text[self.sent_text_len : end]
        self.sent_text_len = end
        ids = self.token_ids[self.sent_token_len :]
        self.sent_token_len = len(self.token_ids)
        tops = self.top_logprobs[self.sent_logprob_len :]
        logprobs = [(lp, tops[i] if i < len(tops) else {})
                    for i, lp in enumerate(self.logprobs[self.sent_logprob_len :])]
        self.sent_logprob_len = len(self.logprobs)
        return text, ids, logprobs
