"""The KV cache's size on a GPU, from what a built runner's largest steps use.

``memory_plan`` decides before anything is allocated; this module runs the largest prefill step,
the largest decode step and the largest captured dynamic bucket once each on padding over a
one-block scratch cache, measures their activation peaks, adds what outlives a step (the graphs'
outputs, the per-request logits processing) and sizes the cache from the free memory left
(``memory_plan.gpu_num_blocks``). vLLM's worker does the same with its runner's profile run.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from corun import logits_processing, memory_plan
from corun.step import StepShape
from models.forward_batch import ForwardBatch, KVCache

if TYPE_CHECKING:
    from corun.model_runner import ModelRunner
    from corun.step_inputs import BoundStep


def profile_context_lens(num_tokens: int, max_model_len: int, num_rows: int) -> tuple[int, ...]:
    """Context lengths of the memory profile's prefill step: ``num_tokens`` cut into sequences
    of at most ``max_model_len`` (no sequence is longer, and its block table has no more
    columns), at most one per chunk row."""
    lengths: list[int] = []
    while num_tokens > 0 and len(lengths) < num_rows:
        lengths.append(min(num_tokens, max_model_len))
        num_tokens -= lengths[-1]
    return tuple(lengths)


def auto_num_blocks(runner: ModelRunner, spec) -> int:
    """What the config can use (``memory_plan.config_num_blocks``); on a GPU bounded by free
    memory, or sized from it under an explicit ``gpu_memory_utilization``."""
    config = runner.config
    if runner.device.type != "cuda":
        return memory_plan.config_num_blocks(config)
    peak = profile_peak_bytes(runner, spec)
    free, total = torch.cuda.mem_get_info(runner.device)
    return memory_plan.gpu_num_blocks(config, free, total, peak,
                                      spec.bytes_per_block(config.block_size, runner.dtype))


def largest_dynamic_shape(runner: ModelRunner) -> StepShape | None:
    """The dynamic modes' largest prefill step: the whole token budget, the most rows."""
    config = runner.config
    if config.is_corun:
        return None
    tokens, rows = runner.prefill_capacity()
    return StepShape(True, tokens, rows, rows, max_q_len=min(tokens, config.max_model_len),
                     is_fixed=False)


def profile_steps(runner: ModelRunner,
                  scratch: KVCache) -> Iterator[tuple[str, BoundStep, ForwardBatch]]:
    """(key, bound buffers, batch) of the largest prefill step and of the largest decode step,
    on padding over ``scratch``. The prefill batch carries the largest contexts a step can
    expand (MLA expands every row's cached context): the step's tokens as whole sequences of
    at most ``max_model_len``, one per chunk row, as far as the rows go.

    Keyed "decode" / "prefill", and "graph": the largest captured dynamic bucket, whose graph
    keeps its memory while eager dynamic steps run beside it."""
    config = runner.config
    largest: dict[str, StepShape] = {}
    for shape in [largest_dynamic_shape(runner)] + runner.fixed_shapes():
        if shape is not None:
            key = "prefill" if shape.is_prefill else "decode"
            if key not in largest or shape.num_tokens > largest[key].num_tokens:
                largest[key] = shape
    if config.use_cuda_graphs and runner.dynamic_buckets \
            and runner.graphable(runner.dynamic_buckets[0]):
        largest["graph"] = runner.dynamic_buckets[0]
    for key, shape in largest.items():
        bufs = runner.buffers_of(shape)
        host = bufs.fill(shape, [])
        bound = bufs.bind(shape, scratch, runner.ops, config.max_model_len, host, cache=False)
        batch = bound.batch
        if shape.is_prefill:
            batch = dataclasses.replace(batch, context_lens_host=profile_context_lens(
                shape.num_tokens, config.max_model_len, batch.block_tables.shape[0]))
        yield key, bound, batch


@torch.inference_mode()
def profile_peak_bytes(runner: ModelRunner, spec) -> int:
    """Activation peak of the largest prefill step and of the largest decode step (their sum
    under ``overlap_prefill_decode``, where both are in flight), plus the largest captured
    dynamic bucket's, each run once on padding over a one-block scratch cache, plus the
    per-request work after the forward (logits processing with its penalty pool at
    max_num_seqs rows, top-N logprobs: ``logits_processing.profile_peak_bytes``)."""
    config = runner.config
    scratch = KVCache(spec, 1, config.block_size, runner.dtype, runner.device)
    peaks = {}
    for key, bound, batch in profile_steps(runner, scratch):
        peaks[key] = memory_plan.cuda_peak_bytes(
            functools.partial(runner.forward, bound, batch), runner.device)
    del scratch
    torch.cuda.empty_cache()
    steps = [peaks[k] for k in ("decode", "prefill") if k in peaks]
    total = sum(steps) if config.overlap_prefill_decode else max(steps)
    processing = logits_processing.profile_peak_bytes(
        runner.sampler, runner.vocab_size, config.max_num_seqs, runner.device,
        config.max_logprobs)
    torch.cuda.empty_cache()
    return total + peaks.get("graph", 0) + graph_output_bytes(runner) + processing


def graph_output_bytes(runner: ModelRunner) -> int:
    """What the captured graphs' outputs hold for as long as the graphs live: each graph keeps
    its own logits, samples and hidden rows (a pool shares only what is freed during a
    capture), which no profiled peak counts."""
    if not runner.config.use_cuda_graphs:
        return 0
    hidden = runner.model_config.hidden_size * runner.dtype.itemsize
    return sum(shape.num_sample_rows * (runner.vocab_size * 4 + 3 * 8)
               + shape.num_tokens * hidden
               for shape in runner.fixed_shapes() if runner.graphable(shape))
