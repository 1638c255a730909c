"""Build completion and chat responses (whole, or as stream chunks) from engine outputs.

A builder owns the ``ChoiceState`` of every choice of one HTTP request: choice index
``prompt_index * n + sample_index``, as vLLM numbers a batch of prompts with ``n`` samples each.
``update`` folds one ``RequestOutput`` in (and records the metrics of finished choices),
``chunks`` turns the changed choices into stream chunks, ``final`` into the whole response.
"""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING, Any

from corun.api.response_models import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    PromptLogprob,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    random_id,
)
from corun.api.streaming import ChoiceState

if TYPE_CHECKING:
    from corun.api.preprocess import Submission
    from corun.api.server import ServerState


class _Builder:
    id_prefix = "cmpl"

    def __init__(self, state: ServerState, body: Any, subs: list[Submission]) -> None:
        self.state = state
        self.body = body
        self.subs = subs
        self.id = random_id(self.id_prefix)
        self.created = int(time.time())
        self.start = time.monotonic()
        self.n = body.n
        self.subs_by_prompt = {sub.prompt_index: sub for sub in subs}
        self.choices: dict[int, ChoiceState] = {}
        for sub in subs:
            decode = partial(state.tokenizer.decode,
                             skip_special_tokens=sub.params.skip_special_tokens)
            for sample in range(self.n):
                index = sub.prompt_index * self.n + sample
                self.choices[index] = ChoiceState(
                    index=index,
                    prompt_len=len(sub.prompt_ids),
                    decode=decode,
                    stop_strings=sub.params.stop_strings,
                    include_stop_str=sub.params.include_stop_str_in_output,
                )
        self._first_chunk_sent: set[int] = set()
        # Set for a response that is not streamed: the engine then hands over finished outputs
        # only (corun.api.server), and the timings come from its commit times.
        self.final_only = False

    def update(self, sub: Submission, output: Any) -> list[ChoiceState]:
        """Fold one RequestOutput in; returns the choices it changed."""
        changed = []
        metrics = self.state.metrics
        for completion in output.outputs:
            choice = self.choices[sub.prompt_index * self.n + completion.index]
            was_finished = choice.finished
            before = choice.num_output_tokens
            prompt_lps = getattr(output, "prompt_logprobs", None)
            prompt_ranks = getattr(output, "prompt_token_ranks", None)
            # A final-only output's gaps are the engine loop's to record (EngineLoop._route):
            # it sees the output even when the client has left.
            for gap in choice.update(completion, output.seed, prompt_lps, prompt_ranks):
                metrics.observe_itl(gap)
            if choice.num_output_tokens != before or choice.finished != was_finished:
                changed.append(choice)
            if choice.finished and not was_finished:
                ttft = None
                times = getattr(completion, "token_times", None)
                if self.final_only:
                    arrival = getattr(getattr(output, "metrics", None), "arrival_time", None)
                    if times and arrival is not None:  # both the engine's perf_counter
                        ttft = times[0] - arrival
                elif choice.first_token_time is not None:
                    ttft = choice.first_token_time - self.start
                metrics.observe_finished(
                    choice.finish_reason,
                    choice.prompt_len,
                    choice.num_output_tokens,
                    ttft,
                    time.monotonic() - self.start,
                )
        return changed

    def num_unfinished(self, subs: Any) -> int:
        """The choices of these submissions that have not finished."""
        return sum(not self.choices[sub.prompt_index * self.n + sample].finished
                   for sub in subs for sample in range(self.n))

    def usage(self) -> UsageInfo:
        prompt = sum(len(sub.prompt_ids) for sub in self.subs)
        completion = sum(c.num_output_tokens for c in self.choices.values())
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    def _ordered(self) -> list[ChoiceState]:
        return [self.choices[i] for i in sorted(self.choices)]

    def _token_text(self, token: int) -> str:
        if self.body.return_tokens_as_token_ids:
            return f"token_id:{token}"
        return self.state.tokenizer.decode([token], skip_special_tokens=False)

    def _token_texts(self, ids: list[int]) -> list[str]:
        return [self._token_text(t) for t in ids]

    def _prompt_logprobs(self, choice: ChoiceState, first: bool) -> list | None:
        """vLLM's ``prompt_logprobs`` of a choice, when the request asked for them: per
        position the prompt token first, then the top-N; a top-N token's rank is its place
        among them, even the prompt token's (vLLM writes the top-N over it)."""
        if not first or self.body.prompt_logprobs is None or choice.prompt_logprobs is None:
            return None
        prompt_ids = self.subs_by_prompt[choice.index // self.n].prompt_ids
        out = []
        for token, entry, token_rank in zip(prompt_ids, choice.prompt_logprobs,
                                            choice.prompt_token_ranks, strict=True):
            if entry is None:
                out.append(None)
                continue
            top = list(entry)[: self.body.prompt_logprobs]
            ranks = {token: token_rank, **{t: place for place, t in enumerate(top, start=1)}}
            out.append({str(t): PromptLogprob(logprob=entry[t], rank=rank,
                                              decoded_token=self._token_text(t))
                        for t, rank in ranks.items()})
        return out

    def _prompt_token_ids(self, choice: ChoiceState, first: bool) -> list[int] | None:
        """vLLM's ``prompt_token_ids`` of a choice with ``return_token_ids``, once."""
        if not first or not self.body.return_token_ids:
            return None
        return list(self.subs_by_prompt[choice.index // self.n].prompt_ids)

    def _is_first(self, choice: ChoiceState) -> bool:
        first = choice.index not in self._first_chunk_sent
        self._first_chunk_sent.add(choice.index)
        return first

    def usage_chunk(self) -> Any:
        """The final ``choices: []`` chunk with usage, when stream_options.include_usage."""
        if not self.body.include_usage:
            return None
        return self._chunk([], usage=self.usage())

    # The stream-chunk and whole-response classes of the endpoint.
    chunk_cls: type = CompletionChunk
    response_cls: type = CompletionResponse

    def _envelope(self, cls: type, choices: list, usage: UsageInfo | None) -> Any:
        return cls(
            id=self.id,
            created=self.created,
            model=self.state.model_name,
            choices=choices,
            usage=usage,
            system_fingerprint=self.state.system_fingerprint,
        )

    def _chunk(self, choices: list, usage: UsageInfo | None = None) -> Any:
        if usage is None and self.body.continuous_usage and len(choices) == 1:
            usage = self._choice_usage(choices[0].index)  # vLLM: its choice's usage so far
        return self._envelope(self.chunk_cls, choices, usage)

    def _choice_usage(self, index: int) -> UsageInfo:
        prompt = self.choices[index].prompt_len
        completion = self.choices[index].num_output_tokens
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion)

    def _response(self, choices: list) -> Any:
        return self._envelope(self.response_cls, choices, self.usage())


class CompletionBuilder(_Builder):
    id_prefix = "cmpl"

    def __init__(self, state: ServerState, body: Any, subs: list[Submission], echo: list[str]):
        super().__init__(state, body, subs)
        self.echo = echo  # per prompt: the prompt text to put first (echo=true), else ""
        self._text_offsets = {i: len(echo[c.index // self.n]) for i, c in self.choices.items()}

    def _logprobs(self, choice: ChoiceState, ids: list[int], lps: list, first: bool):
        """OpenAI's completion logprobs: per token its text, logprob, text offset and the
        {text: logprob} of the most likely ones plus the chosen one (vLLM's). With ``echo`` the
        prompt's tokens come first (the first one's logprob and top list are null)."""
        if self.body.logprobs is None:
            return None
        tokens: list[int] = []
        token_lps: list[float | None] = []
        tops: list[dict[int, float] | None] = []
        echoed = first and self.body.echo and choice.prompt_logprobs is not None
        if echoed:
            prompt_ids = self.subs_by_prompt[choice.index // self.n].prompt_ids
            for token, entry in zip(prompt_ids, choice.prompt_logprobs, strict=True):
                tokens.append(token)
                token_lps.append(None if entry is None else entry[token])
                tops.append(None if entry is None else entry)
        for token, (lp, top) in zip(ids, lps, strict=True):
            tokens.append(token)
            token_lps.append(lp)
            tops.append({**top, token: lp})
        texts = self._token_texts(tokens)
        offsets = []
        if echoed:
            self._text_offsets[choice.index] = 0  # the echoed prompt's tokens come first
        for text in texts:
            offsets.append(self._text_offsets[choice.index])
            self._text_offsets[choice.index] += len(text)
        top_lists: list[dict[str, float] | None] = []
        for token, top in zip(tokens, tops, strict=True):
            if top is None:
                top_lists.append(None)
                continue
            wanted = list(top)[: self.body.logprobs]  # the top-N, most likely first
            if token not in wanted:
                wanted.append(token)  # and the chosen (or prompt) token
            entry: dict[str, float] = {}
            for t in wanted:
                entry.setdefault(self._token_text(t), top[t])
            top_lists.append(entry)
        return CompletionLogprobs(
            text_offset=offsets, token_logprobs=token_lps, tokens=texts, top_logprobs=top_lists
        )

    def _choice(
        self, choice: ChoiceState, text: str, ids: list[int], lps: list[float], first: bool
    ) -> CompletionChoice:
        prefix = self.echo[choice.index // self.n] if first else ""
        return CompletionChoice(
            index=choice.index,
            text=prefix + text,
            logprobs=self._logprobs(choice, ids, lps, first),
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
            seed=choice.seed if (first or choice.finished) else None,
            fingerprint=choice.fingerprint,
            token_ids=ids if self.body.return_token_ids else None,
            prompt_token_ids=self._prompt_token_ids(choice, first),
            prompt_logprobs=self._prompt_logprobs(choice, first),
            routed_experts=choice.routed_experts if choice.finished else None,
        )

    def chunks(self, changed: list[ChoiceState]) -> list[CompletionChunk]:
        out = []
        for choice in changed:
            text, ids, lps = choice.take_delta()
            out.append(self._chunk([self._choice(choice, text, ids, lps, self._is_first(choice))]))
        return out

    def final(self) -> CompletionResponse:
        choices = []
        for choice in self._ordered():
            text, ids, lps = choice.take_delta()
            choices.append(self._choice(choice, text, ids, lps, first=True))
        return self._response(choices)


class ChatBuilder(_Builder):
    id_prefix = "chatcmpl"
    chunk_cls = ChatCompletionChunk
    response_cls = ChatCompletionResponse

    def _logprobs(self, ids: list[int], lps: list) -> ChatLogprobs | None:
        """OpenAI's chat logprobs: per token its logprob and the ``top_logprobs`` most likely."""
        if not self.body.logprobs:
            return None
        content = []
        for token, (lp, top) in zip(ids, lps, strict=True):
            text = self._token_text(token)
            alternatives = [
                TopLogprob(token=t_text, logprob=t_lp, bytes=list(t_text.encode("utf-8")))
                for t_text, t_lp in ((self._token_text(t), t_lp) for t, t_lp in top.items())
            ][: self.body.top_logprobs or 0]
            content.append(TokenLogprob(token=text, logprob=lp, bytes=list(text.encode("utf-8")),
                                        top_logprobs=alternatives))
        return ChatLogprobs(content=content)

    def chunks(self, changed: list[ChoiceState]) -> list[ChatCompletionChunk]:
        out = []
        for choice in changed:
            if self._is_first(choice):  # the role comes first, on its own, as OpenAI sends it
                role = ChatStreamChoice(
                    index=choice.index,
                    seed=choice.seed,
                    delta=DeltaMessage(role=self.body.response_role, content=""),
                )
                # vLLM: every choice's role chunk carries the prompt's ids (and here its
                # logprobs) at the root, and counts no completion tokens yet.
                usage = None
                if self.body.continuous_usage:
                    usage = UsageInfo(prompt_tokens=choice.prompt_len, completion_tokens=0,
                                      total_tokens=choice.prompt_len)
                chunk = self._chunk([role], usage)
                chunk.prompt_token_ids = self._prompt_token_ids(choice, True)
                chunk.prompt_logprobs = self._prompt_logprobs(choice, True)
                chunk.prompt_text = self._prompt_text()
                out.append(chunk)
            text, ids, lps = choice.take_delta()
            out.append(
                self._chunk(
                    [
                        ChatStreamChoice(
                            index=choice.index,
                            delta=DeltaMessage(content=text),
                            logprobs=self._logprobs(ids, lps),
                            finish_reason=choice.finish_reason,
                            stop_reason=choice.stop_reason,
                            seed=choice.seed if choice.finished else None,
                            fingerprint=choice.fingerprint,
                            token_ids=ids if self.body.return_token_ids else None,
                        )
                    ]
                )
            )
        return out

    def final(self) -> ChatCompletionResponse:
        choices = []
        for choice in self._ordered():
            text, ids, lps = choice.take_delta()
            choices.append(
                ChatChoice(
                    index=choice.index,
                    message=ChatResponseMessage(role=self.body.response_role, content=text),
                    logprobs=self._logprobs(ids, lps),
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                    seed=choice.seed,
                    fingerprint=choice.fingerprint,
                    token_ids=ids if self.body.return_token_ids else None,
                    routed_experts=choice.routed_experts,
                )
            )
        # vLLM: a chat response's prompt ids and prompt logprobs sit at its root (one prompt).
        response = self._response(choices)
        response.prompt_token_ids = self._prompt_token_ids(self.choices[0], True)
        response.prompt_logprobs = self._prompt_logprobs(self.choices[0], True)
        response.prompt_text = self._prompt_text()
        return response

    def _prompt_text(self) -> str | None:
        """vLLM's ``prompt_text`` with ``return_prompt_text``: the chat-templated prompt."""
        return self.subs[0].prompt_text if self.body.return_prompt_text else None
