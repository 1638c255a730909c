"""LLMEngine: the step-level API (add / abort / step) that the offline LLM and the server build on.

One ``step()`` = ask the scheduler for a step, do its KV swaps, run the model on it, sample the
rows that sample, and fold the tokens into their sequences (stop conditions, fingerprints).
Determinism is the mode's business (scheduler policy + kernel policy); the engine adds nothing
that depends on other requests: sampling noise is keyed by each request's own seed, sample index
and position, and fingerprints hash each sample's own tokens and logits bits.

Input validation happens in ``add_request`` before anything is queued, so a bad request raises a
``ValueError`` naming the field and leaves every request in flight untouched.
"""

from __future__ import annotations

import itertools
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from corun.config import EngineConfig
from corun.grammar import GrammarCompiler
from corun.model_runner import ModelRunner, StepResult
from corun.outputs import (
    REPLACEMENT_CHAR,
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    settled_text,
)
from corun.sampling_params import SamplingParams
from corun.scheduler import Scheduler, SchedulerOutput
from corun.sequence import Sequence, SequenceStatus
from corun.step import StepPart
from corun.step_timing import StepTimer
from corun.system_fingerprint import system_fingerprint
from corun.tokenizer import decoder_types


@dataclass(frozen=True)
class StepRecord:
    """One profiled step (``LLMEngine(profile_steps=True)``): the device is synchronised around
    it, so ``seconds`` is its wall time, host work included."""

    kind: str  # "decode", "prefill" or "combined" (a decode part with a prefill part)
    num_tokens: int  # padded rows of the step's forwards
    num_real_tokens: int  # scheduled tokens (chunks and decode tokens)
    num_decode_live: int  # live decode rows
    decode_context_tokens: int  # sum of the live decode rows' sequence lengths
    seconds: float


class QueueFullError(RuntimeError):
    """``max_queue_len`` requests are already waiting."""


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float
    prompt: str | None = None
    # Report only the finished output (vLLM's RequestOutputKind.FINAL_ONLY, as LLM.generate
    # asks): the steps before build no output for it.
    final_only: bool = False
    seqs: list[Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def _step_kind(out: SchedulerOutput) -> str:
    return "combined" if out.is_combined else "decode" if out.is_decode else "prefill"


class LLMEngine:
    """One model, one scheduler, one KV cache. Not thread-safe: one thread calls it."""

    def __init__(self, config: EngineConfig, tokenizer=None,
                 model_runner: ModelRunner | None = None, profile_steps: bool = False,
                 time_steps: bool = False) -> None:
        """``profile_steps``: synchronise the device around every step and keep a
        ``StepRecord`` per step in ``step_records`` (benchmarks; it costs a sync per step).
        ``time_steps``: time every step without a sync, for a reader that drains
        ``step_timer.take_finished()`` (the server's metrics); without it ``step_timer`` is
        None and nothing is kept."""
        self.config = config
        self.profile_steps = profile_steps
        self.step_records: list[StepRecord] = []
        self.tokenizer = tokenizer
        # A runner may be shared with another engine of the same model (the benchmark reruns a
        # workload under a different max_num_seqs without rebuilding the model and graphs); only
        # a runner built here is torn down by ``close``.
        self._owns_runner = model_runner is None
        if model_runner is None:
            if config.is_parallel:
                from corun.tp_executor import TPModelRunner

                model_runner = TPModelRunner(config)  # rank 0; starts ranks 1..N-1
            else:
                model_runner = ModelRunner(config)
        self.runner = model_runner
        self.scheduler = Scheduler(config, self.runner.num_kv_blocks)
        self.step_timer = StepTimer(self.runner.device) if time_steps else None
        # EOS: the tokenizer's ids (its own and generation_config.json's: Qwen3 ends chat turns
        # on <|im_end|> and documents on <|endoftext|>; either stops generation), and the model
        # config's where no generation_config.json says otherwise (vLLM then builds its
        # generation config from config.json).
        model_eos = () if getattr(tokenizer, "has_generation_config", False) \
            else (self.runner.model_config.eos_token_id or ())
        eos = [*model_eos, *(getattr(tokenizer, "eos_token_ids", None) or ())]
        self.eos_token_ids = frozenset(int(t) for t in eos)
        # vLLM: the tokenizer's own EOS stops with stop_reason None; every other EOS id is a stop
        # id (update_from_generation_config adds them to stop_token_ids), its stop_reason the id.
        own_eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_id = None if own_eos is None else int(own_eos)
        self.vocab_size = self.runner.vocab_size
        # Structured output's token grammars over this tokenizer (built on first use, cached).
        self.grammar = GrammarCompiler(tokenizer, self.eos_token_ids, self.vocab_size)
        # Everything that decides this engine's bits (corun.system_fingerprint): responses of two
        # engines are comparable bit for bit exactly when theirs are equal.
        self.system_fingerprint = self._fingerprint()
        self.requests: dict[str, Request] = {}
        # The runner's counter, not the engine's: what the runner keeps per sequence id (swapped
        # KV, prompt hidden rows, penalty rows) stays apart across engines that share it.
        self._seq_ids = self.runner.seq_ids
        # A byte-fallback decoder's full decode can take back a byte the incremental text
        # settled (corun.detokenizer): a final-only request's text then still follows the steps,
        # so that it is the text a streamed one ends with.
        self._text_every_step = (tokenizer is not None
                                 and "ByteFallback" in decoder_types(tokenizer))
        self._request_ids = itertools.count()
        self._aborted: list[Request] = []
        self.num_steps = 0

    # -- requests ---------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: object, params: object) -> list[int]:
        """Check one request; returns the prompt ids as ints. ValueError names the field."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
        if isinstance(prompt_token_ids, torch.Tensor):
            prompt_token_ids = prompt_token_ids.tolist()
        if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
            raise ValueError("prompt: expected a non-empty prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids):
            raise ValueError("prompt_token_ids: expected a list of ints")
        ids = [int(t) for t in prompt_token_ids]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[0]} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        max_logprobs = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > max_logprobs:
                raise ValueError(f"{name}: {value} exceeds max_logprobs {max_logprobs}")
        if params.logit_bias:
            bad_bias = [t for t in params.logit_bias if t >= self.vocab_size]
            if bad_bias:
                raise ValueError(f"logit_bias: token id {bad_bias[0]} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        if params.prompt_logprobs is not None and self.config.is_parallel:
            raise ValueError("prompt_logprobs: not supported with tensor_parallel_size > 1")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer (use stop_token_ids)")
        if params.structured is not None:
            self.grammar.index(params.structured)  # compiled here, cached for add_request
        if params.max_tokens == 0 and len(ids) > self.config.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens exceed max_model_len "
                             f"{self.config.max_model_len}")
        if params.max_tokens != 0 and len(ids) >= self.config.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate within "
                             f"max_model_len {self.config.max_model_len}")
        return ids

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, prompt: str | None = None,
                    arrival_time: float | None = None, final_only: bool = False) -> str:
        """Queue a request; returns its id. Raises before queueing anything if it is invalid.
        With ``final_only``, ``step()`` returns its output once, when it finishes (the engine then
        neither detokenizes nor builds an output for it on the steps before)."""
        params = SamplingParams() if params is None else params
        ids = self.validate(prompt_token_ids, params)
        if request_id is None:
            request_id = f"req-{next(self._request_ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: expected a non-empty str, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        max_queue = self.config.max_queue_len
        if max_queue is not None and params.num_samples > max_queue:
            raise ValueError(f"n: {params.num_samples} sequences (n, or best_of) exceed "
                             f"max_queue_len {max_queue}: no wait can queue them")
        if max_queue is not None and len(self.scheduler.waiting) + params.num_samples > max_queue:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests waiting "
                                 f"(max_queue_len {max_queue})")
        # Drawn from the OS, never from a global generator whose state other requests move.
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        now = time.perf_counter() if arrival_time is None else arrival_time
        request = Request(request_id, ids, params, seed, now, prompt, final_only=final_only)
        # vLLM masks every EOS id under min_tokens even with ignore_eos (_all_stop_token_ids).
        masked = frozenset(params.stop_token_set | self.eos_token_ids)
        for index in range(params.num_samples):
            seq = Sequence(next(self._seq_ids), request_id, index, ids, params, seed, now,
                           min_tokens_masked_ids=masked)
            if params.structured is not None:  # each sample walks the grammar on its own
                seq.guide = self.grammar.guide(params.structured)
            request.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = request
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its KV; its last output (finish_reason "abort") comes from the
        next ``step()``. Unknown or finished ids are ignored."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return
        for seq in self.scheduler.abort(request_id):
            self.runner.drop_swapped(seq.seq_id)  # its swapped KV and prompt hidden rows
            self.runner.release(seq.seq_id)
            seq.finish_reason = "abort"
            seq.finish_time = time.perf_counter()
        self._aborted.append(request)

    def _fingerprint(self) -> str:
        return system_fingerprint(self.config, self.eos_token_ids,
                                  self.runner.dynamic_step_tokens, self.runner.weights_digest())

    def update_weights(self, weights: Mapping[str, torch.Tensor] | str | os.PathLike) -> str:
        """Load new weights without a restart; returns the new ``system_fingerprint``.

        ``weights``: named tensors as a checkpoint names them (a trainer's state dict; fused
        projections by their HF module names, as the loader reads them; any floating dtype,
        cast to the engine's), or a checkpoint directory of the same model. Atomic: names,
        shapes and dtypes are all checked before the first copy, and a bad update raises
        ``CheckpointError`` (a ValueError) naming the tensor with the old weights untouched.
        No request may be in flight: one that has run a step would mix two sets of weights, so
        a started request (running, preempted, or decoding) is refused with RuntimeError and
        nothing changes; queued requests that have not started run on the new weights. The
        weights are copied into the existing storage (the CUDA graphs stay valid), the prefix
        cache is emptied (no K/V of the old weights is served again), and the fingerprint is
        that of a fresh engine built on the new weights."""
        if self.has_started_requests():
            raise RuntimeError("update_weights: requests have run steps on the current weights; "
                               "let them finish (or abort them) first")
        self.runner.update_weights(weights)
        self.scheduler.block_manager.allocator.reset_prefix_cache()
        self.system_fingerprint = self._fingerprint()
        return self.system_fingerprint

    def close(self) -> None:
        """Release the runner: its CUDA graphs and, at tensor_parallel_size > 1, the worker
        processes and the process group. Idempotent; the engine cannot step afterwards."""
        if self._owns_runner:
            self.runner.destroy()

    def check_health(self) -> None:
        """Raise if the engine cannot step any more (at tensor_parallel_size > 1: a worker
        died or failed, ``WorkerError``). Cheap; the server calls it while idle."""
        self.runner.check_health()

    @property
    def device_is_cuda(self) -> bool:
        return self.runner.device.type == "cuda"

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def has_started_requests(self) -> bool:
        """Whether any request has run a step and is not yet reported finished."""
        return self.scheduler.has_started() or bool(self._aborted)

    def hold_admissions(self, hold: bool) -> None:
        """Admit no new sequence while ``hold`` (running ones go on): how the server drains the
        engine for a weight update without starting queued requests on the old weights."""
        self.scheduler.holding = hold

    def stats(self) -> dict[str, int | float]:
        manager = self.scheduler.block_manager
        allocator = manager.allocator
        queries, hits = manager.num_prefix_queries, manager.num_prefix_hits
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_swapped": len(self.scheduler.swapped),
            "num_kv_blocks_used": allocator.num_used_blocks,
            "num_kv_blocks": allocator.num_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            # Prefix cache, in prompt tokens (vLLM's queries / hits): the hit rate is hits over
            # queries since the engine started (0.0 before any query, or with caching off).
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "num_prefix_cached_blocks": allocator.num_cached_blocks,
            "num_prefix_evictions": allocator.num_evictions,
        }

    # -- one step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        touched: dict[str, Request] = {r.request_id: r for r in self._aborted}
        self._aborted = []
        timer = self.step_timer
        step_start = timer.start() if timer is not None else None
        out = self.scheduler.schedule()
        for seq, blocks in out.swap_out:  # first: the freed blocks may be reused right below
            self.runner.swap_out(seq.seq_id, blocks)
        for seq in out.swap_in:
            self.runner.swap_in(seq.seq_id, seq.block_table)
        if not out.is_empty:
            self.num_steps += 1
            start = self._sync_time() if self.profile_steps else 0.0
            sampled = self._execute(out)
            for seq in sampled:
                touched[seq.request_id] = self.requests[seq.request_id]
            if timer is not None:  # a step that sampled read its tokens: its forward ended
                timer.finish(step_start, _step_kind(out), out.num_tokens,
                             forward_done=bool(sampled))
            if self.profile_steps:
                self._record_step(out, self._sync_time() - start)
        outputs = []
        for request in touched.values():
            if request.finished or not request.final_only:
                outputs.append(self._make_output(request))
            elif self._text_every_step:
                for seq in self._reported_seqs(request):  # the seqs _make_output decodes
                    self._output_text(seq)
        for request in touched.values():
            if request.finished:
                del self.requests[request.request_id]
        return outputs

    def _sync_time(self) -> float:
        if self.device_is_cuda:
            torch.cuda.synchronize(self.runner.device)
        return time.perf_counter()

    def _record_step(self, out: SchedulerOutput, seconds: float) -> None:
        decodes = out.decode_chunks
        kind = _step_kind(out)
        padded = sum(self.runner.step_shape(part.shape).num_tokens for part in out.parts)
        self.step_records.append(StepRecord(
            kind=kind, num_tokens=padded, num_real_tokens=out.num_tokens,
            num_decode_live=len(decodes), decode_context_tokens=sum(c.end for c in decodes),
            seconds=seconds))

    def _execute(self, out: SchedulerOutput) -> list[Sequence]:
        runner = self.runner
        if out.is_combined:
            # corun with overlap_prefill_decode: the decode part and the prefill part run as two
            # forwards (two CUDA streams), each with the shape it has alone; then each part is
            # committed and sampled exactly as if it had been its own step. The parts hold
            # disjoint sequences, so the order of the two commits changes nobody's bits.
            decode, prefill = out.parts
            decode_result, prefill_result = runner.execute_overlapped(decode, prefill)
            return [*self._commit_part(decode, decode_result),
                    *self._commit_part(prefill, prefill_result)]
        (part,) = out.parts
        return self._commit_part(part, runner.execute(part))

    def _commit_part(self, part: StepPart, result: StepResult) -> list[Sequence]:
        """Commit one step's (or one part's) chunks and fold its sampled tokens into their
        sequences (sample rows in chunk order); returns the sampled sequences."""
        seqs = [c.seq for c in part.sampling_chunks]
        self.scheduler.commit_chunks(part.chunks)
        if not seqs:
            return []
        num = len(seqs)
        samples = result.samples[:num].tolist()  # the step's one device-to-host read
        logprob_list = result.logprobs[:num].tolist() if result.logprobs is not None else None
        id_list = result.logprob_ids[:num].tolist() if result.logprob_ids is not None else None
        now = time.perf_counter()
        for i, seq in enumerate(seqs):
            params = seq.params
            if seq.seq_id in result.prompt_logprobs:
                scores = result.prompt_logprobs[seq.seq_id]
                seq.prompt_logprobs, seq.prompt_token_ranks = scores.logprobs, scores.ranks
                seq.prompt_logits_digests = scores.digests
            if params.max_tokens == 0:  # scoring the prompt: its prefill was the whole work
                seq.finish_reason, seq.finish_time = "length", now
                self._keep_routing(seq)
                self.scheduler.finish(seq)
                self.runner.drop_swapped(seq.seq_id)
                self.runner.release(seq.seq_id)
                continue
            token, d1, d2 = samples[i]
            seq.append_token(token)
            seq.token_times.append(now)
            if seq.guide is not None:
                seq.guide.advance(token)
            seq.fingerprint.update(token, (d1, d2))
            if params.needs_logprobs:
                seq.logprobs.append(logprob_list[i][0])
                if params.logprobs is not None:  # logprobs=0: an empty dict a step, as vLLM
                    top = params.logprobs
                    seq.top_logprobs.append(dict(zip(id_list[i][1:1 + top],
                                                     logprob_list[i][1:1 + top], strict=True)))
            if seq.first_token_time is None:
                seq.first_token_time = now
            if self._check_stop(seq):
                seq.finish_time = now
                self._keep_routing(seq)
                self.scheduler.finish(seq)
                self.runner.release(seq.seq_id)
        return seqs

    def _keep_routing(self, seq: Sequence) -> None:
        """A finishing sequence's routed experts, read while its blocks still hold them."""
        seq.routed_experts = self.runner.routed_experts_of(seq.block_table,
                                                           seq.num_computed_tokens)

    def _check_stop(self, seq: Sequence) -> bool:
        """Set the finish reason if ``seq`` just ended; the order follows vLLM's."""
        token, params = seq.token_ids[-1], seq.params
        # Every step, so the window of new text moves on during min_tokens too.
        stop_match = (self._match_stop_string(seq)
                      if params.stop_strings and self.tokenizer is not None else None)
        if seq.num_output_tokens < params.min_tokens:  # vLLM: no stop before min_tokens
            if seq.num_tokens >= self.config.max_model_len:
                seq.finish_reason = "length"
            return seq.finish_reason is not None
        if not params.ignore_eos and token == self.eos_token_id:
            seq.finish_reason = "stop"
            self._cut_stop_token_text(seq)
        elif token in params.stop_token_set or (not params.ignore_eos
                                                and token in self.eos_token_ids):
            seq.finish_reason, seq.stop_reason = "stop", token
            self._cut_stop_token_text(seq)
        elif stop_match is not None:
            pos, stop = stop_match
            seq.finish_reason, seq.stop_reason = "stop", stop
            seq.stop_text_len = pos + len(stop) if params.include_stop_str_in_output else pos
        elif (seq.num_output_tokens >= params.max_tokens
              or seq.num_tokens >= self.config.max_model_len):
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _match_stop_string(self, seq: Sequence) -> tuple[int, str] | None:
        """The first string of ``stop`` found in the text the newest token added (its position
        and the string), as vLLM's ``check_stop_strings``: a match must end past the text of the
        previous step, and past the text of the first ``min_tokens`` tokens."""
        text = self._output_text(seq)
        # Characters a later token may still change (an incomplete UTF-8 sequence) are new again.
        checked, seq.stop_checked_chars = seq.stop_checked_chars, len(text.rstrip(REPLACEMENT_CHAR))
        if seq.num_output_tokens <= seq.params.min_tokens:
            return None
        for stop in seq.params.stop_strings:
            pos = text.find(stop, max(0, checked - len(stop) + 1))
            if pos >= 0:
                return pos, stop
        return None

    def _cut_stop_token_text(self, seq: Sequence) -> None:
        """A stop id or EOS ends the output without its own text unless
        ``include_stop_str_in_output`` (vLLM; the token id stays in the output)."""
        if self.tokenizer is not None and not seq.params.include_stop_str_in_output:
            # Without the stop token, the text before it may end in a character only the stop
            # token completes: that character is the stop token's too.
            before = self._decode(seq.output_token_ids[:-1], seq.params)
            seq.stop_text_len = len(before.rstrip(REPLACEMENT_CHAR))

    def _output_text(self, seq: Sequence) -> str:
        """The decode of ``seq``'s output tokens: the stop check and the step's output both read
        it, and ``IncrementalText`` decodes once a step, the few tokens of a window."""
        return seq.detokenized.update(lambda ids: self._decode(ids, seq.params),
                                      seq.output_token_ids)

    def _decode(self, token_ids: list[int], params: SamplingParams) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)

    def _reported_seqs(self, request: Request) -> list[Sequence]:
        """The sequences a request reports: all of them, or with ``best_of`` > n, once all are
        finished, the n with the highest cumulative logprob (ties: lowest sample index), as
        sample indices 0..n-1 in that order (vLLM's semantics); an aborted request reports its
        first n samples."""
        params = request.params
        if params.num_samples == params.n:
            return request.seqs
        if not request.finished:
            return []
        if any(s.finish_reason == "abort" for s in request.seqs):
            # Partial samples do not rank (a sample that never ran would sum to 0, the best).
            return request.seqs[: params.n]
        ranked = sorted(request.seqs, key=lambda s: (-sum(s.logprobs), s.sample_index))
        return ranked[: params.n]

    def _make_output(self, request: Request) -> RequestOutput:
        completions = []
        for index, seq in enumerate(self._reported_seqs(request)):
            tokens = seq.output_token_ids
            text = delta_text = None
            finished = seq.status is SequenceStatus.FINISHED
            if self.tokenizer is not None:
                text = self._output_text(seq)
                if seq.stop_text_len is not None:
                    text = text[: seq.stop_text_len]
                if not finished:
                    text = settled_text(text, seq.params.stop_strings,
                                        seq.params.include_stop_str_in_output)
                delta_text = text[seq.num_reported_chars:]
                seq.num_reported_chars = max(seq.num_reported_chars, len(text))
            delta = tokens[seq.num_reported_tokens:]
            seq.num_reported_tokens = len(tokens)
            # The live lists, not copies: an unfinished output's token_ids / logprobs keep growing
            # with later steps (a consumer that keeps them copies; a finished one is final).
            completions.append(CompletionOutput(
                index=index, token_ids=tokens, delta_token_ids=delta, text=text,
                delta_text=delta_text, finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                fingerprint=seq.fingerprint.hexdigest() if finished else None,
                logprobs=seq.logprobs if seq.params.logprobs is not None else None,
                top_logprobs=seq.top_logprobs if seq.params.logprobs is not None else None,
                num_preemptions=seq.num_preemptions, token_times=seq.token_times,
                routed_experts=seq.routed_experts if finished else None,
            ))
        firsts = [s.first_token_time for s in request.seqs if s.first_token_time is not None]
        finishes = [s.finish_time for s in request.seqs]
        metrics = RequestMetrics(
            arrival_time=request.arrival_time, first_token_time=min(firsts) if firsts else None,
            finish_time=max(finishes) if request.finished and None not in finishes else None,
            num_output_tokens=max(s.num_output_tokens for s in request.seqs),
        )
        return RequestOutput(request.request_id, request.prompt_token_ids, completions,
                             request.finished, request.seed, request.prompt, metrics,
                             prompt_logprobs=request.seqs[0].prompt_logprobs,
                             prompt_token_ranks=request.seqs[0].prompt_token_ranks,
                             prompt_logits_digests=request.seqs[0].prompt_logits_digests)
