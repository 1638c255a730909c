"""ModelRunner: the model, its paged KV cache, the static step buffers and the step graphs.

``execute(part)`` runs one ``StepPart`` (a shape from the scheduler and its chunks): it fills the
shape's views of the static step buffers (one host-to-device copy), replays the shape's CUDA graph
or runs the same forward eagerly, and returns a ``StepResult``: per sample row the sampled token
and the logits digest (one [R, 3] int64 tensor, read by the engine with one device-to-host copy),
plus the fp32 logits. The forward, the LM head on the sample rows, the sampler and the digest are
one function of the buffers, so a graph replays all of it and eager runs exactly the same ops.

The shapes the model sees are exactly the scheduler's: under corun a decode step is ``B`` rows
whatever the number of live sequences, a prefill step ``T`` tokens in ``R`` chunk rows (packed) or
its chunk's bucket (isolated). ``max_seq_len`` (the decode attention grid bound) is
``max_model_len`` for every fixed shape, so the launch never depends on the other sequences; a
dynamic default-mode step uses the batch's longest sequence.

Two buffer sets: decode and prefill, so that under ``overlap_prefill_decode`` a decode step and a
prefill step can be in flight together (``execute_overlapped``: the decode on the current stream,
the prefill on a second one).

Tensor parallelism: a runner is one rank's (``parallel``): it builds that rank's shard, holds
that rank's KV-cache shard and runs the same steps as its peers; ``corun.tp_executor`` sends each
step's filled buffer to the peers (``_publish``). Every rank gets the full-vocabulary logits (the
model gathers them); rank 0 reads the samples.

Swap (preemption): ``swap_out`` copies a sequence's blocks to host memory, ``swap_in`` copies
them back into the blocks the scheduler gave it; the bytes are unchanged, so attention, which
reads through the block table, computes the same bits afterwards.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from corun import memory_plan, memory_profile
from corun.config import DYNAMIC_GRAPH_PREFILL_ROWS, EngineConfig
from corun.fingerprint import LogitsDigest
from corun.graph_runner import GraphRunner
from corun.logits_processing import PenaltyPool, resample_processed
from corun.prompt_logprobs import PromptScorer, PromptScores
from corun.sampler import Sampler, SamplingTensors
from corun.step import (
    StepPart,
    StepShape,
    dynamic_buckets,
    dynamic_decode_counts,
    smallest_bucket,
)
from corun.step_inputs import BoundStep, StepBuffers, StepHost
from kernels.mode import Mode
from models.forward_batch import ForwardBatch, KVCache, OpsConfig
from models.parallel import SINGLE, ParallelContext


@dataclass
class StepResult:
    """Device outputs of one executed part: ``samples`` [R, 3] int64 (token id, digest d1, d2)
    per sample row, the first ``num_sampled`` real; ``logits`` [R, V] fp32 (raw). When a row
    asked for logprobs: ``logprob_ids`` [R, 1 + K] (the sampled token, then the K most likely)
    and ``logprobs`` [R, 1 + K] theirs, K the largest ``logprobs`` N of the step's rows.
    ``prompt_logprobs``: per sequence whose prompt finished its prefill in this part and asked
    for them, ``PromptScorer.score``'s ``PromptScores``."""

    samples: torch.Tensor
    logits: torch.Tensor
    logprobs: torch.Tensor | None
    num_sampled: int
    logprob_ids: torch.Tensor | None = None
    prompt_logprobs: dict[int, PromptScores] = dataclasses.field(default_factory=dict)



def check_model_len(config: EngineConfig, model_config) -> None:
    """Before building anything: no sequence may outrun the positions the model serves (its
    RoPE table ends there; vLLM refuses such a max_model_len too). ``model_config`` None: an
    unreadable checkpoint config, which building the model reports."""
    longest = None if model_config is None else model_config.max_sequence_length
    if longest is not None and config.max_model_len > longest:
        raise ValueError(
            f"max_model_len: {config.max_model_len} exceeds the {longest} positions the model "
            f"serves (max_position_embeddings, or YaRN's original_max_position_embeddings x "
            f"factor)")


class ModelRunner:
    """Owns the model, the KV cache, the sampler, the step buffers and the step graphs."""

    def __init__(self, config: EngineConfig, model: tuple | None = None,
                 parallel: ParallelContext = SINGLE) -> None:
        """``model``: an already built ``(model, ModelConfig)`` of ``config.model`` to reuse
        (the benchmark runs every mode on one set of weights); built from the config otherwise.
        ``parallel``: this runner's tensor-parallel rank (its process group already set up)."""
        from models import build_model

        self.config = config
        self.parallel = parallel
        self.device = torch.device(config.resolved_device)
        if parallel.is_parallel and self.device.type == "cuda":
            self.device = torch.device("cuda", parallel.rank)  # one GPU per rank
        self.dtype = config.torch_dtype
        # Weights this runner builds are its own to free (``destroy``); given ones are not.
        self._owns_model = model is None
        # Before building anything (config.json read once): the positions and the memory.
        model_config = model[1] if model is not None else memory_plan.model_config_of(
            config.model)
        check_model_len(config, model_config)
        if model is None:
            self._check_memory(model_config)
            model = build_model(config.model, dtype=self.dtype, device=self.device,
                                seed=config.seed, parallel=parallel)
        self.model, self.model_config = model
        self.ops = OpsConfig(mode=config.kernel_mode, backend=config.resolved_backend,
                             decode_split_size=config.decode_split_size,
                             decode_fused_combine=config.decode_fused_combine,
                             path_invariant=config.is_path_invariant)
        self.vocab_size = self.model_config.vocab_size
        self.block_width = config.max_blocks_per_seq
        self.sampler = Sampler(config.resolved_backend, self.device)
        self.digest = LogitsDigest(self.vocab_size, self.device)
        spec = self.model.kv_cache_spec()
        # Decode attention's fused combine counts arrivals per (row, kv head) in a buffer each
        # stream of steps holds (StepBuffers): decode and prefill steps may overlap on two
        # streams, so they must not share one.
        self._arrival_heads = spec.num_kv_heads if (
            self.ops.decode_fused_combine and self.ops.backend == "triton"
            and spec.kind == "mha") else 0
        # The dynamic modes' small prefill / mixed steps run padded to these fixed shapes; by
        # default only where a graph can replay them (padding alone would only add work).
        tokens = config.dynamic_step_tokens
        if config.dynamic_graph_tokens is None and not self.model.supports_prefill_graphs:
            tokens = []
        self.dynamic_buckets = dynamic_buckets(
            tokens, dynamic_decode_counts(config.max_num_seqs),
            min(DYNAMIC_GRAPH_PREFILL_ROWS, config.max_num_seqs),
            max_chunk=min(config.prefill_chunk_size, config.max_model_len))
        self.decode_buffers = self._buffers(max(config.decode_buckets),
                                            max(config.decode_buckets))
        self.prefill_buffers = self._buffers(*self._prefill_buffer_capacity())
        self.num_kv_blocks = self._agree_num_blocks(
            config.num_kv_blocks or memory_profile.auto_num_blocks(self, spec))
        self.kv_cache = KVCache(spec, self.num_kv_blocks, config.block_size, self.dtype,
                                self.device)
        self.routed_experts = self._routed_experts() if config.enable_return_routed_experts \
            else None
        # Blocks are dim 2 of the MHA storage [L, 2, NB, ...] and dim 1 of the MLA one [L, NB, ...].
        self._block_dim = 2 if spec.kind == "mha" else 1
        self._host_kv: dict[int, torch.Tensor] = {}
        self._host_routed: dict[int, torch.Tensor] = {}
        self.prompt_scorer = PromptScorer(
            lambda hidden: self.model.compute_logits(hidden, self.ops), self.sampler,
            self.digest)
        self.penalty_pool = PenaltyPool(self.device, config.max_num_seqs)
        # Sequence ids for every engine on this runner (LLMEngine takes them from here): the
        # per-sequence state above is keyed by them.
        self.seq_ids = itertools.count()
        self.graph_runner: GraphRunner | None = None
        if config.use_cuda_graphs:
            self.graph_runner = GraphRunner(self.device)
            self.capture_graphs()

    def _buffers(self, max_tokens: int, max_seqs: int) -> StepBuffers:
        return StepBuffers(max_tokens, max_seqs, max_seqs, self.block_width,
                           self.config.block_size, self.device, self._arrival_heads)

    def _prefill_buffer_capacity(self) -> tuple[int, int]:
        """(tokens, rows) of the prefill step buffers: the largest prefill step's, with the rows
        of a dynamic bucket where it has more (its padded decode rows)."""
        tokens, rows = self.prefill_capacity()
        return tokens, max([rows] + [b.num_seqs for b in self.dynamic_buckets])

    def prefill_capacity(self) -> tuple[int, int]:
        """(tokens, rows) of the largest prefill step the scheduler can make."""
        config = self.config
        if config.is_packed_prefill:
            return config.prefill_step_tokens, config.max_prefill_seqs_per_step
        if config.is_corun:
            return max(config.prefill_buckets), 1
        return config.max_num_batched_tokens, config.max_num_seqs

    # -- fixed shapes and their graphs ------------------------------------------------------------

    def fixed_shapes(self) -> list[StepShape]:
        """Every fixed step shape of this config, largest first within decode and prefill."""
        config = self.config
        shapes = [StepShape.decode(b) for b in sorted(config.decode_buckets, reverse=True)]
        if config.is_packed_prefill:
            shapes.append(StepShape.packed_prefill(config.prefill_step_tokens,
                                                   config.max_prefill_seqs_per_step,
                                                   config.prefill_chunk_size))
        elif config.is_corun:
            shapes += [StepShape.isolated_prefill(b)
                       for b in sorted(config.prefill_buckets, reverse=True)]
        return shapes + self.dynamic_buckets

    @property
    def dynamic_step_tokens(self) -> list[int]:
        """Token counts of the dynamic buckets this runner pads to (the config's, less where
        the model captures no prefill graphs), ascending."""
        return sorted({b.num_tokens for b in self.dynamic_buckets})

    def eager_twin(self) -> EngineConfig:
        """This runner's config without CUDA graphs and with its step shapes: the eager run of
        the same steps, which must give the bits of this runner's graph replays."""
        return dataclasses.replace(self.config, cuda_graphs=False,
                                   dynamic_graph_tokens=tuple(self.dynamic_step_tokens))

    def step_shape(self, shape: StepShape) -> StepShape:
        """The shape a scheduled step runs at: a dynamic step that fits one of the dynamic
        buckets runs padded to the smallest (``corun.step.smallest_bucket``); every other step
        at its own shape."""
        if shape.is_fixed or not self.dynamic_buckets:
            return shape
        return smallest_bucket(shape, self.dynamic_buckets) or shape

    @property
    def num_graphs(self) -> int:
        """CUDA graphs captured (0 without graphs)."""
        return 0 if self.graph_runner is None else len(self.graph_runner.graphs)

    def graphable(self, shape: StepShape) -> bool:
        return shape.is_fixed and (not shape.is_prefill or self.model.supports_prefill_graphs)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture every graphable fixed shape (decode and prefill pools apart, largest first)."""
        for shape in self.fixed_shapes():
            if not self.graphable(shape):
                continue
            bufs = self.buffers_of(shape)
            bufs.fill(shape, [])  # all padding: the capture's own runs write and read nothing
            bound = self._bind(shape, bufs)
            self.graph_runner.capture(shape, "prefill" if shape.is_prefill else "decode",
                                      lambda bound=bound: self.forward(bound))

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run every fixed shape once on padding (JIT compilation before anything is timed).
        Captured shapes were warmed up by their capture."""
        for shape in self.fixed_shapes():
            if self.graph_runner is not None and self.graph_runner.can_replay(shape):
                continue
            bufs = self.buffers_of(shape)
            host = bufs.fill(shape, [])
            self._launch(shape, bufs, host)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- KV cache sizing (the GPU profile: corun.memory_profile) ------------------------------

    def _check_memory(self, model_config) -> None:
        """Before building anything: the weights and the KV cache this config asks for fit in
        the device's available memory, or a ValueError says what to change. ``model_config``
        None: an unreadable checkpoint config."""
        if model_config is None:
            return  # unreadable checkpoint config: building the model reports why
        memory = memory_plan.plan(self.config, model_config)
        memory_plan.check_fits(memory, memory_plan.available_bytes(self.device), self.config)

    def _agree_num_blocks(self, num_blocks: int) -> int:
        """The same block count on every rank: the scheduler (rank 0) hands out block ids that
        index every rank's cache shard. The smallest rank's count fits everywhere (free memory
        can differ between GPUs); at TP=1 it is ``num_blocks`` itself."""
        if not self.parallel.is_parallel:
            return num_blocks
        import torch.distributed as dist

        agreed = torch.tensor([num_blocks], dtype=torch.int64, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.parallel.group)
        return int(agreed.item())

    # -- running steps ----------------------------------------------------------------------------

    def buffers_of(self, shape: StepShape) -> StepBuffers:
        return self.prefill_buffers if shape.is_prefill else self.decode_buffers

    def _bind(self, shape: StepShape, bufs: StepBuffers,
              host: StepHost | None = None) -> BoundStep:
        # max_model_len for every fixed shape: a graph bakes the host int in, and corun /
        # batch_invariant must not size the decode grid by the other sequences. A dynamic
        # default-mode step sizes it by its own longest sequence.
        max_seq_len = self.config.max_model_len
        if not shape.is_fixed and self.ops.mode is Mode.DEFAULT:
            max_seq_len = host.max_seq_len
        return bufs.bind(shape, self.kv_cache, self.ops, max_seq_len, host,
                         routed_experts=self.routed_experts)

    def forward(self, bound: BoundStep, batch: ForwardBatch | None = None,
                all_greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The whole step on the bound views: forward, LM head on the sample rows, sampler and
        logits digest -> (logits [R, V] fp32, samples [R, 3] int64, hidden [T, H] of every row,
        which prompt logprobs read). Captured as one graph."""
        all_hidden = self.model(bound.input_ids, batch or bound.batch)
        hidden = all_hidden
        if bound.sample_rows is not None:
            hidden = hidden.index_select(0, bound.sample_rows)
        logits = self.model.compute_logits(hidden, self.ops)
        tensors = SamplingTensors(bound.temperature, bound.top_k, bound.top_p, bound.seeds,
                                  bound.sample_indices, bound.sample_positions,
                                  all_greedy=all_greedy, want_logprobs=False)
        token_ids = self.sampler.sample(logits, tensors)
        return logits, torch.cat([token_ids.view(-1, 1), self.digest(logits)], dim=1), all_hidden

    def _launch(self, shape: StepShape, bufs: StepBuffers,
                host: StepHost) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Replay the shape's graph, or run the same forward eagerly."""
        if self.graph_runner is not None and self.graph_runner.can_replay(shape):
            return self.graph_runner.replay(shape)
        bound = self._bind(shape, bufs, host)
        batch = bound.batch
        if shape.is_prefill and shape.is_fixed:  # per-step host ints of a reused binding
            batch = dataclasses.replace(batch, context_lens_host=host.context_lens)
        # The greedy shortcut is the torch backend's (a host flag); a graph never takes it.
        return self.forward(bound, batch, all_greedy=host.all_greedy)

    def _publish(self, shape: StepShape, bufs: StepBuffers, host: StepHost) -> None:
        """Hand a filled step to the other tensor-parallel ranks (nothing to do at TP=1)."""

    @torch.inference_mode()
    def receive_and_launch(self, header) -> None:
        """A tensor-parallel worker's step: rank 0's filled buffer arrives by broadcast into
        this rank's buffer of the same layout, then the same shape runs (``corun.tp_executor``)."""
        import torch.distributed as dist

        bufs = self.buffers_of(header.shape)
        dist.broadcast(bufs.dev, src=0, group=self.parallel.group)
        self._launch(header.shape, bufs, header.host)

    def _result(self, part: StepPart, host: StepHost, logits: torch.Tensor,
                samples: torch.Tensor, hidden: torch.Tensor) -> StepResult:
        """The part's outputs, after the per-request work that reads the step's outputs row by
        row: logits processing (a processed row is re-sampled), logprobs, prompt logprobs."""
        seqs = [c.seq for c in part.sampling_chunks]
        if host.any_processing:
            samples = resample_processed(self.sampler, logits, samples, seqs, self.penalty_pool)
        logprobs = ids = None
        if host.want_logprobs:
            ids, logprobs = self.sampler.logprobs_with_top(logits, samples[:, :1],
                                                           host.max_top_logprobs)
        prompt = self.prompt_scorer.collect(part, host, hidden) if host.prefill_rows else {}
        return StepResult(samples, logits, logprobs, len(seqs), ids, prompt)

    @torch.inference_mode()
    def execute(self, part: StepPart) -> StepResult:
        """Fill ``part``'s shape (``step_shape``) from its chunks, run it, and sample its sample
        rows."""
        shape = self.step_shape(part.shape)
        bufs = self.buffers_of(shape)
        host = bufs.fill(shape, part.chunks)
        self._publish(shape, bufs, host)
        return self._result(part, host, *self._launch(shape, bufs, host))

    @torch.inference_mode()
    def execute_overlapped(self, decode: StepPart,
                           prefill: StepPart) -> tuple[StepResult, StepResult]:
        """One combined corun step: a decode part and a prefill part, as two forwards.

        Each part is exactly the forward ``execute`` gives it alone (same shapes, kernels and
        configs), so its bits do not change; the parts read and write disjoint KV blocks (their
        sequences differ; dummy rows write nothing and read nothing) and no kernel of one part
        reduces across the other, so running them concurrently changes nothing either.

        On CUDA the decode (a graph replay) goes first on the current stream, then the prefill on
        a second stream, so the compute-bound prefill fills the SMs the weight- and KV-bound
        decode leaves idle; the current stream then waits for the second one, so everything after
        (the next step's copies and KV writes) is ordered after both. The two parts' graphs live
        in separate memory pools. On the CPU the two forwards run one after the other.
        """
        if self.device.type != "cuda":
            return self.execute(decode), self.execute(prefill)
        d_bufs, p_bufs = self.buffers_of(decode.shape), self.buffers_of(prefill.shape)
        if d_bufs is p_bufs:
            raise ValueError("execute_overlapped: expects a decode part and a prefill part")
        d_host = d_bufs.fill(decode.shape, decode.chunks)
        p_host = p_bufs.fill(prefill.shape, prefill.chunks)
        main, side = torch.cuda.current_stream(self.device), self._prefill_stream()
        side.wait_stream(main)  # the prefill's inputs were copied on the current stream
        d_out = self._launch(decode.shape, d_bufs, d_host)
        with torch.cuda.stream(side):
            p_out = self._launch(prefill.shape, p_bufs, p_host)
        main.wait_stream(side)
        # Made on ``side`` and read on ``main``: without this the allocator could hand an eager
        # prefill's outputs to the next allocation on ``side`` while ``main`` still reads them.
        for tensor in p_out:
            if tensor.numel():
                tensor.record_stream(main)
        return (self._result(decode, d_host, *d_out),
                self._result(prefill, p_host, *p_out))

    def _prefill_stream(self) -> torch.cuda.Stream:
        stream = getattr(self, "_side_stream", None)
        if stream is None:
            stream = self._side_stream = torch.cuda.Stream(self.device)
        return stream

    # -- swap -------------------------------------------------------------------------------------

    def swap_out(self, seq_id: int, blocks: list[int]) -> None:
        index = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        host = self.kv_cache.storage.index_select(self._block_dim, index)
        self._host_kv[seq_id] = host.to("cpu", non_blocking=False)
        if self.routed_experts is not None:
            self._host_routed[seq_id] = self.routed_experts.block_rows(blocks)

    def swap_in(self, seq_id: int, block_table: list[int]) -> None:
        """Copy the host copy into the first blocks of the sequence's new block table."""
        host = self._host_kv.pop(seq_id)
        num_blocks = host.shape[self._block_dim]
        if num_blocks > len(block_table):
            raise RuntimeError(f"seq {seq_id}: {num_blocks} blocks swapped out, "
                               f"{len(block_table)} given back")
        index = torch.tensor(block_table[:num_blocks], dtype=torch.int64, device=self.device)
        self.kv_cache.storage.index_copy_(self._block_dim, index, host.to(self.device))
        if self.routed_experts is not None:
            self.routed_experts.restore(block_table[:num_blocks], self._host_routed.pop(seq_id))

    def drop_swapped(self, seq_id: int) -> None:
        """Forget a finished or aborted sequence's host state (swapped KV, prompt hidden rows)."""
        self._host_kv.pop(seq_id, None)
        self._host_routed.pop(seq_id, None)
        self.prompt_scorer.drop(seq_id)

    def release(self, seq_id: int) -> None:
        """Free what the sampling side keeps of a finished sequence (its penalty row). Rank 0's
        alone under tensor parallelism: the workers do not sample."""
        self.penalty_pool.release(seq_id)

    @property
    def num_swapped_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._host_kv.values())

    def check_health(self) -> None:
        """Nothing to check at TP=1 (``TPModelRunner`` checks its workers)."""

    # -- routing replay ---------------------------------------------------------------------------

    def _routed_experts(self):
        from corun.routed_experts import RoutedExperts

        c = self.model_config
        layers = [i for i in range(c.num_hidden_layers) if c.is_moe_layer(i)]
        if not layers:
            raise ValueError(f"enable_return_routed_experts: {self.config.model} has no MoE "
                             f"layer to route")
        return RoutedExperts(self.num_kv_blocks * self.config.block_size, self.config.block_size,
                             layers, c.num_experts_per_tok, c.num_experts, self.device)

    def routed_experts_of(self, block_table: list[int], num_tokens: int):
        """A sequence's routed experts [num_tokens, MoE layers, k] (numpy), or None when the
        engine does not record them; read before its blocks are freed."""
        if self.routed_experts is None:
            return None
        return self.routed_experts.read(block_table, num_tokens)

    # -- weights ----------------------------------------------------------------------------------

    def weights_digest(self) -> str:
        """``models.weights.weights_digest`` of this rank's model (the system fingerprint's
        weights)."""
        from models.weights import weights_digest

        return weights_digest(self.model)

    def update_weights(self, weights: Mapping[str, torch.Tensor] | str | os.PathLike) -> None:
        """New weights for this model, copied into its own storage (the CUDA graphs keep
        reading it): named tensors as a checkpoint names them, or a checkpoint directory of
        the same model. Everything is validated before the first copy (``CheckpointError``
        naming the tensor, the weights untouched); then the derived weights (MLA's W_UK) are
        recomputed in place."""
        from models.loader import check_checkpoint, copy_tensors, load_weights, plan_tensors

        if isinstance(weights, (str, os.PathLike)):
            check_checkpoint(self.model, self.model_config, weights)
            load_weights(self.model, self.model_config, weights)
        else:
            weights = dict(weights)
            copy_tensors(self.model, plan_tensors(self.model, self.model_config, weights),
                         weights)
        self.model.process_weights_after_loading()

    def destroy(self) -> None:
        """Release the graphs, the KV cache, the step buffers and the weights this runner built
        (a runner given ``model`` shares them with whoever built them). The runner cannot step
        again; an engine still referencing it no longer pins their memory."""
        if self.graph_runner is not None:
            self.graph_runner.destroy()
            self.graph_runner = None
        self.kv_cache.storage = torch.empty(0, dtype=self.dtype, device=self.device)
        self._host_kv.clear()
        self.prompt_scorer.clear()
        self.penalty_pool = PenaltyPool(self.device, self.config.max_num_seqs)
        for bufs in (self.decode_buffers, self.prefill_buffers):
            bufs.release()
        if self._owns_model:
            self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
