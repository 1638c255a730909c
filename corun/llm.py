"""LLM: the offline API (vLLM-shaped): ``LLM(model=..., mode="corun").generate(prompts, params)``.

``generate`` accepts a str, a list of str, a list of token-id lists, or dicts with
``prompt_token_ids`` (or ``prompt``); ``params`` is one SamplingParams or one per prompt. It
validates every prompt first (a bad one raises ``ValueError`` naming the field and nothing is
queued), runs the engine until all are done, and returns one ``RequestOutput`` per prompt in input
order: token ids, text (with a tokenizer), finish reason, seed and fingerprint per sample.

Under ``mode="corun"`` (and ``batch_invariant``) a prompt's output, fingerprint included, is the
same whatever else is in the call, in any order, at any concurrency: an evaluation or an RL rollout
can be replayed request by request from its seeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from corun.config import EngineConfig
from corun.engine import LLMEngine
from corun.outputs import RequestOutput
from corun.sampling_params import SamplingParams, generation_defaults_of
from corun.tokenizer import Tokenizer, tokenizer_for_model

PromptType = str | list[int] | dict


class LLM:
    """An engine plus a tokenizer. ``**config`` are ``EngineConfig`` fields.

    ``tensor_parallel_size=N`` shards the model over N ranks (N GPUs, or N CPU processes with
    gloo): this process is rank 0 and starts N - 1 worker processes. They stop on ``close()``
    (also ``with LLM(...) as llm:`` and garbage collection); a worker that fails makes
    ``generate`` raise ``models.parallel.WorkerError`` and stops the others.
    """

    def __init__(self, model: str = "tiny-qwen3", mode: str = "corun",
                 tokenizer: str | Tokenizer | None = None, skip_tokenizer_init: bool = False,
                 generation_config: str = "auto", **config) -> None:
        """``tokenizer``: a directory or a Tokenizer; None = the server's for ``model``
        (``corun.tokenizer.tokenizer_for_model``: the checkpoint's, or the byte-level one of a
        named config), so the same request gives the same bits offline and served.
        ``skip_tokenizer_init``: no tokenizer at all (token-id prompts, no text, no EOS from a
        tokenizer), as vLLM's flag. ``generation_config``: where ``generate`` without params
        gets its defaults (``get_default_sampling_params``), as vLLM's argument: "auto" = the
        checkpoint's generation_config.json, "vllm" = none, or a folder holding one."""
        self.engine: LLMEngine | None = None  # set last: __del__ may run on a failed __init__
        self._closed = False
        self.config = EngineConfig(model=model, mode=mode, **config)
        self.default_sampling = generation_defaults_of(generation_config, model)
        if isinstance(tokenizer, (str, Path)):
            tokenizer = Tokenizer.from_dir(tokenizer)
        if skip_tokenizer_init:
            tokenizer = None
        elif tokenizer is None:
            tokenizer = tokenizer_for_model(model)[0]
        self.tokenizer = tokenizer
        self.engine = LLMEngine(self.config, self.tokenizer)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json values (vLLM's)."""
        return SamplingParams(**self.default_sampling)

    @property
    def system_fingerprint(self) -> str:
        """What decides this LLM's bits (``corun.system_fingerprint``); the server's responses
        carry the same value for the same model and config."""
        return self.engine.system_fingerprint

    def close(self) -> None:
        """Stop the engine (worker processes included); idempotent."""
        if self.engine is not None and not self._closed:
            self._closed = True
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM was closed; create a new one")

    def _to_ids(self, prompt: object) -> tuple[list[int], str | None]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt["prompt_token_ids"], prompt.get("prompt")
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer; pass token ids "
                                 "(prompt_token_ids) or LLM(tokenizer=...)")
            if not prompt:
                raise ValueError("prompt: expected a non-empty prompt")
            return self.tokenizer.encode(prompt), prompt
        return prompt, None

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        self._check_open()
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts: expected at least one prompt")
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            params_list = [params] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError(f"params: {len(params_list)} SamplingParams for "
                                 f"{len(prompts)} prompts")
        # Validate everything before queueing anything: a bad prompt leaves the engine untouched.
        requests = []
        for prompt, p in zip(prompts, params_list, strict=True):
            ids, text = self._to_ids(prompt)
            requests.append((self.engine.validate(ids, p), p, text))
        order: list[str] = []
        try:
            for ids, p, text in requests:
                # add_request may still refuse one (queue full, n beyond max_queue_len)
                order.append(self.engine.add_request(ids, p, prompt=text, final_only=True))
            return self._run(order, use_tqdm)
        except BaseException:
            # A call that fails part-way (a refused request, a step that raised, an interrupt)
            # takes its requests with it, as vLLM's LLM does: left queued they would hold the
            # queue and be run to the end by the next call, for nobody.
            for request_id in order:
                self.engine.abort_request(request_id)
            raise

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the chat template to one conversation (or a list of them) and generate."""
        if self.tokenizer is None:
            raise ValueError("messages: chat needs a tokenizer with a chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.tokenizer.apply_chat_template(
            c, add_generation_prompt=add_generation_prompt)} for c in conversations]
        return self.generate(prompts, params, use_tqdm)

    def _run(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(order) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(order), desc="generate", unit="req", dynamic_ncols=True)
        pending = set(order)
        try:
            while pending:
                for output in self.engine.step():
                    if output.finished and output.request_id in pending:
                        done[output.request_id] = output
                        pending.discard(output.request_id)
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [done[request_id] for request_id in order]
