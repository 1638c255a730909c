"""LLM: the offline API (vLLM-shaped): ``LLM(model=..., mode="corun").generate(prompts, params)``.

``generate`` accepts a str, a list of str, a list of token-id lists, or dicts with
``prompt_token_ids`` (or ``prompt``); ``params`` is one SamplingParams or one per prompt. It
validates every prompt first (a bad one raises ``ValueError`` naming the field and nothing is
queued), runs the engine until all are done, and returns one ``RequestOutput`` per prompt in input
order: token ids, text (with a tokenizer), finish reason, seed and fingerprint per sample.

Under ``mode="corun"`` (and ``batch_invariant``) a prompt's output, fingerprint included, is the
same whatever else is in the call, in any order, at any concurrency: an evaluation or an RL rollout
can be replayed request by request from its seeds.

``score`` is teacher forcing: the logprobs of given tokens after a prompt, in one prefill. Under
path invariance (``EngineConfig.path_invariant``, on in every deterministic mode) a token's
scored logprob, top logprobs and fingerprint are the bits ``generate`` gave it when it sampled
the token, so an RL trainer can take its rollouts' logprobs from either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from corun.config import EngineConfig
from corun.engine import LLMEngine
from corun.fingerprint import Fingerprint
from corun.outputs import RequestOutput, ScoreOutput
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

    @classmethod
    def from_engine(cls, engine: LLMEngine, tokenizer: Tokenizer | None = None,
                    generation_config: str = "vllm") -> LLM:
        """An LLM over an engine built elsewhere (benchmarks run several modes' engines on one
        set of weights, ``LLMEngine(config, model_runner=...)``). ``close`` closes the engine."""
        llm = cls.__new__(cls)
        llm.engine, llm._closed = engine, False
        llm.config, llm.tokenizer = engine.config, tokenizer
        llm.default_sampling = generation_defaults_of(generation_config, engine.config.model)
        return llm

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json values (vLLM's)."""
        return SamplingParams(**self.default_sampling)

    @property
    def system_fingerprint(self) -> str:
        """What decides this LLM's bits (``corun.system_fingerprint``); the server's responses
        carry the same value for the same model and config."""
        return self.engine.system_fingerprint

    def update_weights(self, weights: Mapping[str, torch.Tensor] | str | Path) -> str:
        """New weights without a restart (RL between rollouts): named tensors as a checkpoint
        names them (``corun.training.Policy.checkpoint_weights()``, a trainer's state dict with
        HF names) or a checkpoint directory of the same model. Atomic, in place (the CUDA
        graphs stay valid), the prefix cache emptied; returns the new ``system_fingerprint``,
        that of a fresh LLM on the same weights (``LLMEngine.update_weights``)."""
        self._check_open()
        return self.engine.update_weights(weights)

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

    def score(self, prompts: PromptType | Sequence[PromptType],
              completions: Sequence[list[int] | str] | None = None, *, logprobs: int = 0,
              use_tqdm: bool = True) -> list[ScoreOutput]:
        """Teacher-forced scoring: each completion's tokens given its prompt, one prefill of
        prompt + completion each (no sampling). ``completions`` None: each prompt is a whole
        sequence and every token after its first is scored. ``logprobs``: also the N most likely
        tokens at each scored position (``ScoreOutput.top_logprobs``). Every item is validated
        before any work starts. The engine's prefill of the sequences may share steps, chunks
        and prefix-cache hits with anything; under path invariance the bits are those the
        tokens got when sampled (``ScoreOutput``)."""
        self._check_open()
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
            if completions is not None and (isinstance(completions, str) or (
                    completions and isinstance(completions[0], int))):
                completions = [completions]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts: expected at least one prompt")
        if completions is not None and len(completions) != len(prompts):
            raise ValueError(f"completions: {len(completions)} completions for "
                             f"{len(prompts)} prompts")
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0:
            raise ValueError(f"logprobs: expected an int >= 0, got {logprobs!r}")
        pairs = []
        for i, prompt in enumerate(prompts):
            ids = list(self._to_ids(prompt)[0])
            if completions is None:
                if len(ids) < 2:
                    raise ValueError(f"prompts[{i}]: a sequence to score needs at least two "
                                     f"tokens (the first is scored by nothing)")
                pairs.append((ids[:1], ids[1:]))
                continue
            completion = completions[i]
            if isinstance(completion, str):
                completion = self._to_ids(completion)[0]
            completion = list(completion)
            if not completion:
                raise ValueError(f"completions[{i}]: expected at least one token")
            pairs.append((ids, completion))
        params = SamplingParams(max_tokens=0, prompt_logprobs=logprobs)
        outputs = self.generate([{"prompt_token_ids": p + c} for p, c in pairs], params,
                                use_tqdm=use_tqdm)
        return [_score_output(p, c, out, logprobs) for (p, c), out in
                zip(pairs, outputs, strict=True)]

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


def _score_output(prompt: list[int], completion: list[int], out: RequestOutput,
                  top_n: int) -> ScoreOutput:
    """The completion's positions of a prompt-logprobs result, and the fingerprint the same
    tokens carry when sampled: (token, digest of the row that predicted it) in order."""
    first = len(prompt)
    entries = out.prompt_logprobs[first:]
    fingerprint = Fingerprint()
    for token, digest in zip(completion, out.prompt_logits_digests[first:], strict=True):
        fingerprint.update(token, digest)
    return ScoreOutput(
        prompt_token_ids=prompt, completion_token_ids=completion,
        logprobs=[entry[token] for token, entry in zip(completion, entries, strict=True)],
        # An entry holds the top-N, most likely first, then the token itself when not among them.
        top_logprobs=[dict(list(entry.items())[:top_n]) for entry in entries] if top_n else None,
        fingerprint=fingerprint.hexdigest())
