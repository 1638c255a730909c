"""ModelRunner: the model, its paged KV cache, and the flat inputs of each step.

``prepare_prefill`` / ``prepare_decode`` turn a scheduler step into ``(input_ids, ForwardBatch)``;
``run`` returns the fp32 logits rows of the tokens that sample. Decode steps replay a CUDA graph
when one was captured for the padded batch size (``GraphRunner``), else run eagerly (always on the
CPU). The shapes the model sees are exactly the scheduler's: under corun a decode step is ``B`` rows
whatever the number of live sequences, a prefill step is one sequence's aligned chunk.

``max_seq_len`` (the decode attention grid bound) is ``max_model_len`` under corun and
batch_invariant, so the launch shape never depends on the other sequences; under default it is the
batch's longest sequence when eager (a captured graph is fixed at ``max_model_len``).

Tensor parallelism: a runner is one rank's (``parallel``): it builds that rank's shard, holds that
rank's KV-cache shard and runs the same steps as its peers; ``corun.tp_executor`` keeps the ranks
in step. Every rank gets the full-vocabulary logits (the model gathers them); rank 0 samples.

Swap (preemption): ``swap_out`` copies a sequence's blocks to host memory, ``swap_in`` copies
them back into the blocks the scheduler gave it; the bytes are unchanged, so attention, which
reads through the block table, computes the same bits afterwards.
"""

from __future__ import annotations

import numpy as np
import torch

from corun.config import EngineConfig
from corun.fingerprint import LogitsDigest
from corun.graph_runner import GraphRunner
from corun.sampler import Sampler
from corun.scheduler import ScheduledChunk
from kernels.mode import Mode
from models.forward_batch import ForwardBatch, KVCache, OpsConfig
from models.parallel import SINGLE, ParallelContext

# Memory kept free beyond the profiled peak when sizing the cache from free GPU memory: the
# decode graphs' pool and allocator fragmentation.
_GPU_RESERVE_BYTES = 2 << 30


class ModelRunner:
    """Owns the model, the KV cache, the sampler and the decode graphs of one engine."""

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
        if model is None:
            model = build_model(config.model, dtype=self.dtype, device=self.device,
                                seed=config.seed, parallel=parallel)
        self.model, self.model_config = model
        self.ops = OpsConfig(mode=config.kernel_mode, backend=config.resolved_backend,
                             decode_split_size=config.decode_split_size)
        self.vocab_size = self.model_config.vocab_size
        self.block_width = config.max_blocks_per_seq
        spec = self.model.kv_cache_spec()
        self.num_kv_blocks = self._agree_num_blocks(
            config.num_kv_blocks or self._auto_num_blocks(spec))
        self.kv_cache = KVCache(spec, self.num_kv_blocks, config.block_size, self.dtype,
                                self.device)
        # Blocks are dim 2 of the MHA storage [L, 2, NB, ...] and dim 1 of the MLA one [L, NB, ...].
        self._block_dim = 2 if spec.kind == "mha" else 1
        self._host_kv: dict[int, torch.Tensor] = {}
        self.sampler = Sampler(config.resolved_backend, self.device)
        self.digest = LogitsDigest(self.vocab_size, self.device)
        self.graph_runner: GraphRunner | None = None
        if config.use_cuda_graphs:
            self.graph_runner = GraphRunner(self, config.decode_buckets)
            self.graph_runner.capture()

    # -- KV cache sizing --------------------------------------------------------------------------

    def _auto_num_blocks(self, spec) -> int:
        per_block = spec.bytes_per_block(self.config.block_size, self.dtype)
        if self.device.type != "cuda":
            # CPU: room for max_num_seqs full-length sequences (no memory to profile against).
            return self.config.max_num_seqs * self.block_width
        peak = self._profile_peak_bytes(spec)
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.config.gpu_memory_utilization - (total - free) - peak
        num_blocks = int((budget - _GPU_RESERVE_BYTES) // per_block)
        if num_blocks * self.config.block_size < self.config.max_model_len:
            raise ValueError(
                f"gpu_memory_utilization: {self.config.gpu_memory_utilization} leaves room for "
                f"{max(num_blocks, 0)} KV blocks, less than one max_model_len sequence"
            )
        return num_blocks

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

    @torch.inference_mode()
    def _profile_peak_bytes(self, spec) -> int:
        """Activation peak of the largest prefill step, run once on a one-block scratch cache."""
        scratch = KVCache(spec, 1, self.config.block_size, self.dtype, self.device)
        num_tokens = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        if self.config.is_corun:
            num_tokens = min(self.config.prefill_chunk_size, self.config.max_model_len)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        i32 = dict(dtype=torch.int32, device=self.device)
        batch = ForwardBatch(
            is_prefill=True, positions=torch.arange(num_tokens, device=self.device),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros(1, self.block_width, **i32), kv_cache=scratch, ops=self.ops,
            cu_seqlens_q=torch.tensor([0, num_tokens], **i32),
            context_lens=torch.tensor([num_tokens], **i32), max_q_len=num_tokens,
            max_seq_len=num_tokens, token_mask=torch.ones(num_tokens, dtype=torch.bool,
                                                          device=self.device))
        hidden = self.model(ids, batch)
        rows = min(self.config.max_num_seqs, num_tokens)
        self.model.compute_logits(hidden[:rows], self.ops)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del scratch, hidden, batch
        torch.cuda.empty_cache()
        return peak

    # -- step inputs ------------------------------------------------------------------------------

    def _slot(self, block_table: list[int], position: int) -> int:
        size = self.config.block_size
        return block_table[position // size] * size + position % size

    def _block_tables(self, tables: list[list[int]], num_rows: int) -> torch.Tensor:
        """[num_rows, block_width] int32, zero-padded (rows past ``tables`` are dummies).

        Filled through numpy: a Python list of B x max_blocks ints would cost milliseconds per
        decode step at B = 128 and long contexts.
        """
        rows = np.zeros((num_rows, self.block_width), dtype=np.int32)
        for i, table in enumerate(tables):
            rows[i, : len(table)] = table
        return torch.from_numpy(rows).to(self.device)

    def _max_seq_len(self, longest: int) -> int:
        return longest if self.ops.mode is Mode.DEFAULT else self.config.max_model_len

    def prepare_prefill(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, ForwardBatch, list[int]]:
        """Chunks -> (input_ids [T], batch, rows of the tokens that sample, in ``chunks`` order).

        Decode tokens the dynamic schedule mixed into the step (chunks of sequences past their
        prompt) go first, as ``num_decode_tokens`` with the seq_lens and grid bound of a decode
        step, then the prefill chunks back to back: attention runs the decode tokens through the
        decode path, so their bits do not depend on which requests prefill beside them.
        """
        decodes = [c for c in chunks if not c.seq.is_prefilling]
        prefills = [c for c in chunks if c.seq.is_prefilling]
        ids, positions, slots, cu = [], [], [], [0]
        last_row: dict[int, int] = {}  # id(chunk) -> its last token's row
        for row, chunk in enumerate(decodes):
            seq = chunk.seq
            ids.append(seq.token_ids[chunk.start])
            positions.append(chunk.start)
            slots.append(self._slot(seq.block_table, chunk.start))
            last_row[id(chunk)] = row
        for chunk in prefills:
            seq = chunk.seq
            ids.extend(seq.token_ids[chunk.start:chunk.end])
            positions.extend(range(chunk.start, chunk.end))
            slots.extend(self._slot(seq.block_table, p) for p in range(chunk.start, chunk.end))
            cu.append(cu[-1] + chunk.num_tokens)
            last_row[id(chunk)] = len(decodes) + cu[-1] - 1
        dev, i32 = self.device, torch.int32
        num_tokens = len(ids)
        # The decode grid bound as prepare_decode sets it (max_model_len unless default).
        longest = max(c.end for c in (decodes or prefills))
        batch = ForwardBatch(
            is_prefill=True,
            positions=torch.tensor(positions, dtype=torch.int64).to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev),
            block_tables=self._block_tables([c.seq.block_table for c in decodes + prefills],
                                            len(chunks)),
            kv_cache=self.kv_cache, ops=self.ops,
            cu_seqlens_q=torch.tensor(cu, dtype=i32).to(dev),
            context_lens=torch.tensor([c.end for c in prefills], dtype=i32).to(dev),
            max_q_len=max((c.num_tokens for c in prefills), default=0),
            seq_lens=torch.tensor([c.end for c in decodes], dtype=i32).to(dev) if decodes else None,
            max_seq_len=self._max_seq_len(longest),
            token_mask=torch.ones(num_tokens, dtype=torch.bool, device=dev),
            num_decode_tokens=len(decodes),
        )
        sample_rows = [last_row[id(c)] for c in chunks if c.samples]
        return torch.tensor(ids, dtype=torch.int64).to(dev), batch, sample_rows

    def prepare_decode(
        self, chunks: list[ScheduledChunk], num_slots: int
    ) -> tuple[torch.Tensor, ForwardBatch]:
        """One token per live sequence in slots 0..n-1, dummies up to ``num_slots``.

        A dummy slot has token 0 at position 0, slot -1 (nothing written), seq_len 0 (attention
        gives zeros), an all-zero block row, and token_mask False (MoE routing skips it).
        """
        num_live, num_pad = len(chunks), num_slots - len(chunks)
        if num_pad < 0:
            raise ValueError(f"num_slots: {num_slots} < {num_live} live sequences")
        seqs = [c.seq for c in chunks]
        dev = self.device
        seq_lens = [s.num_tokens for s in seqs]
        batch = ForwardBatch(
            is_prefill=False,
            positions=torch.tensor([n - 1 for n in seq_lens] + [0] * num_pad,
                                   dtype=torch.int64).to(dev),
            slot_mapping=torch.tensor([self._slot(s.block_table, s.num_tokens - 1) for s in seqs]
                                      + [-1] * num_pad, dtype=torch.int64).to(dev),
            block_tables=self._block_tables([s.block_table for s in seqs], num_slots),
            kv_cache=self.kv_cache, ops=self.ops,
            seq_lens=torch.tensor(seq_lens + [0] * num_pad, dtype=torch.int32).to(dev),
            max_seq_len=self._max_seq_len(max(seq_lens)),
            token_mask=torch.tensor([True] * num_live + [False] * num_pad).to(dev),
        )
        ids = torch.tensor([s.token_ids[-1] for s in seqs] + [0] * num_pad, dtype=torch.int64)
        return ids.to(dev), batch

    # -- running ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, batch: ForwardBatch,
            sample_rows: list[int] | None = None) -> torch.Tensor:
        """Logits [N, V] fp32 of the sampled rows (decode: every slot, dummies included)."""
        if not batch.is_prefill and self.graph_runner is not None \
                and self.graph_runner.can_replay(input_ids.shape[0]):
            return self.graph_runner.replay(input_ids, batch)
        hidden = self.model(input_ids, batch)
        if sample_rows is not None:
            if not sample_rows:
                return hidden.new_empty(0, self.vocab_size, dtype=torch.float32)
            hidden = hidden[torch.tensor(sample_rows, device=hidden.device)]
        return self.model.compute_logits(hidden, self.ops)

    @torch.inference_mode()
    def run_overlapped(
        self, decode: tuple[torch.Tensor, ForwardBatch],
        prefill: tuple[torch.Tensor, ForwardBatch, list[int]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One combined corun step: (decode logits [B, V], prefill logits [rows, V]).

        Each part is exactly the forward ``run`` gives it alone (same shapes, same kernels and
        configs), so its bits do not change; the parts read and write disjoint KV blocks (their
        sequences differ; dummy decode slots write nothing and read nothing) and no kernel of one
        part reduces across the other, so running them concurrently changes nothing either.

        On CUDA the decode (graph replay, a single launch) goes first on the current stream, then
        the prefill's eager kernels on a second stream, so the compute-bound prefill fills the
        SMs the weight-bound decode leaves idle; the current stream then waits for the second
        one, so everything after (sampling, the next step's KV writes) is ordered after both. On
        the CPU the two forwards run one after the other.
        """
        if self.device.type != "cuda":
            return self.run(*decode), self.run(*prefill)
        main = torch.cuda.current_stream(self.device)
        side = self._prefill_stream()
        # The prefill's inputs were copied to the device on the current stream.
        side.wait_stream(main)
        decode_logits = self.run(*decode)
        with torch.cuda.stream(side):
            prefill_logits = self.run(*prefill)
        main.wait_stream(side)
        # Made on ``side`` and read on ``main``: without this the allocator could hand its memory
        # to the next allocation on ``side`` once it is freed while ``main`` still reads it. The
        # prefill's inputs (made on ``main``, read on ``side``) are still referenced by the caller
        # here, so any reuse of their memory on ``main`` is ordered after the wait above.
        if prefill_logits.numel():  # a chunk that does not sample has no allocation to guard
            prefill_logits.record_stream(main)
        return decode_logits, prefill_logits

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

    def swap_in(self, seq_id: int, block_table: list[int]) -> None:
        """Copy the host copy into the first blocks of the sequence's new block table."""
        host = self._host_kv.pop(seq_id)
        num_blocks = host.shape[self._block_dim]
        if num_blocks > len(block_table):
            raise RuntimeError(f"seq {seq_id}: {num_blocks} blocks swapped out, "
                               f"{len(block_table)} given back")
        index = torch.tensor(block_table[:num_blocks], dtype=torch.int64, device=self.device)
        self.kv_cache.storage.index_copy_(self._block_dim, index, host.to(self.device))

    def drop_swapped(self, seq_id: int) -> None:
        self._host_kv.pop(seq_id, None)

    @property
    def num_swapped_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._host_kv.values())

    def check_health(self) -> None:
        """Nothing to check at TP=1 (``TPModelRunner`` checks its workers)."""

    def destroy(self) -> None:
        if self.graph_runner is not None:
            self.graph_runner.destroy()
            self.graph_runner = None
