"""EngineConfig: every knob of one engine instance, frozen and validated at construction.

The mode (DESIGN.md, "Three modes, one engine") picks both the kernel policy (``OpsConfig.mode``)
and the batching policy of the scheduler; everything else is sizing. Derived values (the torch
dtype, the resolved device and backend, the decode graph buckets) are properties, never written
back: a changed config is a new value made with ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kernels.mode import Mode

_DTYPES = ("float32", "float16", "bfloat16")
PREFILL_POLICIES = ("packed", "isolated")
# The smallest isolated-prefill bucket: shorter chunks are padded up to it.
MIN_PREFILL_BUCKET = 16
# Token counts the dynamic modes' prefill and mixed steps are captured at on CUDA (when
# ``dynamic_graph_tokens`` is left to None), as vLLM captures mixed batches. An eager Qwen3-8B
# step keeps the H200's host busy ~34 ms with launches (the cuda-graphs ablation's eager decode
# step), about the GPU time of a 1024-token step: below that a graph saves more than the padding
# costs, above it the step is GPU-bound and stays eager. Steps of 128 and 256 tokens between
# 256 and 1024 bound the padding to 1.5x.
DYNAMIC_GRAPH_TOKENS = (128, 256, 384, 512, 768, 1024)
# Prefill chunk rows of a captured dynamic step (beside its decode tokens). The steps that
# eager launches slow down are small ones: a prompt or two arriving while others decode.
DYNAMIC_GRAPH_PREFILL_ROWS = 4
# max_model_len when none is given: this, or fewer when the model serves fewer positions.
DEFAULT_MAX_MODEL_LEN = 2048
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                  "bf16": "bfloat16"}


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """One engine: which model, which mode, how large.

    - ``model``: a named config of ``models`` (``tiny-qwen3``, ``qwen3-8b``, ...) or a checkpoint
      directory.
    - ``dtype``: ``"bfloat16"`` / ``"float16"`` / ``"float32"`` (a torch.dtype is accepted too and
      kept as given; ``torch_dtype`` normalises); None (``"auto"``): bfloat16 on CUDA, float32 on
      the CPU, the one default of ``LLM`` and the server.
    - ``device``: ``"cuda"``, ``"cpu"``, ... or None for CUDA when present, else CPU.
    - ``max_model_len``: prompt + output tokens a sequence may hold; None: 2048, or the
      positions the model serves when fewer, resolved at construction (so
      ``dataclasses.replace(config, model=...)`` keeps the first model's; pass
      ``max_model_len=None`` with it to derive it again). The engine refuses a value above the
      model's positions.
    - ``backend``: ``"triton"`` or ``"torch"``; None picks triton on CUDA, torch on the CPU.
    - ``num_kv_blocks``: KV blocks of ``block_size`` tokens; None sizes the cache to what the
      config can use (``max_num_seqs`` + 1 full-length sequences, ``corun.memory_plan``), on a
      GPU at most what 90% of it leaves free.
    - ``gpu_memory_utilization``: None, or a fraction of the GPU: the cache takes all that this
      fraction leaves after the weights and activations (room for preemption-free overload).
    - ``decode_batch_size``: ``B``, the fixed decode batch of corun mode (None = max_num_seqs).
      With ``max_num_seqs > B`` corun may prefill ahead: sequences past their prompt wait, in
      arrival order, for one of the B decode slots.
    - ``prefill_chunk_size``: ``C``. corun cuts a prompt into chunks that end at multiples of C
      (or at the prompt's end): a function of the prompt's own length only. The dynamic modes cap
      a single chunk by it as well (batch_invariant also aligns its cuts, see the scheduler).
    - ``prefill_policy`` (corun): ``"packed"``: aligned chunks of several requests share one
      prefill step of exactly ``prefill_step_tokens`` tokens and ``max_prefill_seqs_per_step``
      chunk rows, padded with dummies, so every shape inside the step is fixed (and the step
      replays one CUDA graph); ``"isolated"`` (the paper's): one chunk per step, padded to the
      next of ``prefill_buckets`` (a function of the chunk's own length).
    - ``prefill_step_tokens``: ``T`` of a packed prefill step (>= C).
    - ``max_prefill_seqs_per_step``: ``R``, chunk rows (and LM-head rows) of a packed step.
    - ``prefill_token_budget``: corun's stall bound: while requests are decoding, prefill steps
      whose padded token counts add up to at most this run between two decode steps (at least one
      runs when prefill work is waiting).
    - ``max_num_batched_tokens``: the token budget of one dynamic-mode step (prefill chunks and
      decode tokens together).
    - ``overlap_prefill_decode``: corun only. A decode step also carries one prefill step of
      sequences that are not decoding; on CUDA the decode (graph replay) runs on the current
      stream and the prefill on a second stream, overlapping the weight- and KV-bound decode with
      the compute-bound prefill; on the CPU they run one after the other. No bits change: each
      part has exactly the shapes and configs it has when run alone. The carried prefill step
      counts against ``prefill_token_budget``. Not supported with ``tensor_parallel_size > 1``
      (the two parts' collectives on two streams of one communicator could interleave
      differently per rank).
    - ``decode_fused_combine``: decode attention combines a sequence's splits in its split
      launch (the last lane to finish does it) instead of a second launch; the same bits either
      way (kernels/attention.py), so a speed knob only, off until timed on the H200.
    - ``cuda_graphs``: capture every fixed-shape step as a CUDA graph (decode at its buckets;
      corun's prefill shapes too, where the model allows it) and replay it (ignored off CUDA).
    - ``dynamic_graph_tokens`` (the dynamic modes): token counts at which a prefill or mixed
      step is padded to a fixed shape and replayed from its graph, as vLLM captures mixed
      batches: a step of at most that many tokens, at most ``DYNAMIC_GRAPH_PREFILL_ROWS``
      prefill chunks and its decode tokens, runs at the smallest such shape (its decode tokens
      padded to 0, 4, 16, 64, ... or max_num_seqs - 1 with dummy slots, dummy tokens after the
      real ones); larger steps run eagerly at their exact shape. None: ``DYNAMIC_GRAPH_TOKENS``
      up to ``max_num_batched_tokens`` when graphs are on (and the model captures prefill
      steps), none otherwise; ``()``: none.
      Given explicitly, the steps are padded even without graphs (an eager run at the graphs'
      shapes: ``ModelRunner.eager_twin``). The batch-invariant modes keep their
      bits either way; ``default`` runs its kernels at the padded shapes.
    - ``seed``: the seed of the random model weights (named configs); request seeds are separate.
    - ``max_queue_len``: waiting requests beyond this are refused (None = unbounded).
    - ``tensor_parallel_size``: N ranks, each holding a shard of the model and of the KV cache
      (one GPU per rank with NCCL on CUDA, one CPU process per rank with gloo). The engine's
      process is rank 0 and schedules; ranks 1..N-1 are worker processes (``corun.tp_executor``).
    - ``enable_prefix_caching``: reuse the K/V of full prompt blocks another sequence already
      prefilled (vLLM's automatic prefix caching). A hit keeps the bits: a request's output is
      the same whether 0, some or all of its prompt was cached (under corun and
      batch_invariant), because hits are rounded down to ``prefix_cache_granularity`` tokens.
    - ``distributed_timeout_s``: how long a rank waits for its peers in one collective (and at
      start-up) before it fails; a dead worker is normally noticed much sooner (its exit or its
      closed connections).
    - ``max_logprobs``: the largest top-N a request may ask for (``logprobs``,
      ``prompt_logprobs``; vLLM's default 20).
    - ``enable_return_routed_experts`` (MoE models): every finished sample carries the experts
      each MoE layer routed each of its tokens to (``CompletionOutput.routed_experts``; vLLM's
      flag, for RL frameworks' routing replay), kept per KV slot (``corun.routed_experts``).
    - ``path_invariant`` (the deterministic modes): a token's logprob, top logprobs and logits
      digest have the same bits whether a decode step sampled it or a prefill scored it
      (``LLM.score``, prompt logprobs, ``corun.training``): every GEMM keeps a row's bits at
      every M (corun's take the tuned batch-invariant tiles, never split-K) and prefill
      attention folds each row's keys in the decode's splits. None: on, except under
      ``default`` (which promises nothing, and refuses True); False: corun's GEMMs may split K
      by M and prefill attention runs a row as one split (each path stays deterministic).
    """

    model: str = "tiny-qwen3"
    dtype: object = None
    device: str | None = None
    mode: Mode | str = Mode.CORUN
    backend: str | None = None
    max_num_seqs: int = 32
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float | None = None
    decode_batch_size: int | None = None
    prefill_chunk_size: int = 256
    prefill_policy: str = "packed"
    prefill_step_tokens: int = 8192
    max_prefill_seqs_per_step: int = 64
    prefill_token_budget: int = 8192
    max_num_batched_tokens: int = 2048
    overlap_prefill_decode: bool = False
    decode_split_size: int = 512
    decode_fused_combine: bool = False
    cuda_graphs: bool = True
    dynamic_graph_tokens: tuple[int, ...] | None = None
    seed: int = 0
    max_queue_len: int | None = None
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 120.0
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    path_invariant: bool | None = None
    enable_return_routed_experts: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(
                f"model: expected a named config or a checkpoint path, got {self.model!r}"
            )
        if not isinstance(self.mode, Mode):
            # Mode.parse raises the ValueError naming the field; a frozen dataclass keeps what it
            # was given, so the parsed value is exposed as the ``kernel_mode`` property.
            Mode.parse(self.mode, "mode")
        self._dtype_name()  # validates dtype
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", self._default_max_model_len())
        if self.backend not in (None, "triton", "torch"):
            raise ValueError(f"backend: expected 'triton', 'torch' or None, got {self.backend!r}")
        for name in ("max_num_seqs", "max_model_len", "block_size", "prefill_chunk_size",
                     "max_num_batched_tokens", "prefill_step_tokens", "max_prefill_seqs_per_step",
                     "prefill_token_budget"):
            _positive(name, getattr(self, name))
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(f"prefill_policy: expected one of {', '.join(PREFILL_POLICIES)}, "
                             f"got {self.prefill_policy!r}")
        # The backend as resolved (None is Triton on CUDA): a cut-short batch-invariant chunk
        # ends on the query tile, so a budget below the tile would never schedule one.
        if self.kernel_mode.is_batch_invariant and self.prefill_alignment > 1:
            if self.prefill_chunk_size % self.prefill_alignment:
                raise ValueError(f"prefill_chunk_size: {self.prefill_chunk_size} is not a "
                                 f"multiple of {self.prefill_alignment}, the prefill kernel's "
                                 f"query tile: batch_invariant chunks must end on it")
            if self.max_num_batched_tokens < self.prefill_alignment:
                raise ValueError(f"max_num_batched_tokens: {self.max_num_batched_tokens} is "
                                 f"below {self.prefill_alignment}, the prefill kernel's query "
                                 f"tile: no batch_invariant chunk that a step cuts short fits")
        if self.is_packed_prefill and self.prefill_step_tokens < self.prefill_chunk_size:
            raise ValueError(f"prefill_step_tokens: {self.prefill_step_tokens} cannot hold one "
                             f"chunk of prefill_chunk_size {self.prefill_chunk_size}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: expected a power of two, got {self.block_size}")
        if self.decode_batch_size is not None:
            _positive("decode_batch_size", self.decode_batch_size)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) \
                or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs: expected an int >= 0, got {self.max_logprobs!r}")
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
            # One full-length sequence must always fit, or preemption could not make progress.
            if self.num_kv_blocks * self.block_size < self.max_model_len:
                raise ValueError(
                    f"num_kv_blocks: {self.num_kv_blocks} blocks of {self.block_size} tokens "
                    f"cannot hold one sequence of max_model_len {self.max_model_len}"
                )
        if self.gpu_memory_utilization is not None \
                and not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization: expected in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens: {self.max_num_batched_tokens} is below max_num_seqs "
                f"{self.max_num_seqs}, so a full decode step would not fit the token budget"
            )
        # The decode attention kernels tile a split in 16-, 32- or 64-token KV blocks.
        split = self.decode_split_size
        if isinstance(split, bool) or not isinstance(split, int) or split < 16 or split % 16:
            raise ValueError(
                f"decode_split_size: expected a positive multiple of 16, got {split!r}")
        if not isinstance(self.decode_fused_combine, bool):
            raise ValueError(f"decode_fused_combine: expected a bool, "
                             f"got {self.decode_fused_combine!r}")
        if self.dynamic_graph_tokens is not None:
            tokens = self.dynamic_graph_tokens
            if not isinstance(tokens, (tuple, list)) or any(
                    isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tokens):
                raise ValueError(f"dynamic_graph_tokens: expected None or a tuple of positive "
                                 f"ints, got {tokens!r}")
            if any(t > self.max_num_batched_tokens for t in tokens):
                raise ValueError(f"dynamic_graph_tokens: {sorted(tokens)} has counts above "
                                 f"max_num_batched_tokens {self.max_num_batched_tokens}, which "
                                 f"no dynamic step reaches")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(f"seed: expected an int in [0, 2**64), got {self.seed!r}")
        if self.max_queue_len is not None:
            _positive("max_queue_len", self.max_queue_len)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if not isinstance(self.overlap_prefill_decode, bool):
            raise ValueError(f"overlap_prefill_decode: expected a bool, "
                             f"got {self.overlap_prefill_decode!r}")
        if self.overlap_prefill_decode and not self.is_corun:
            raise ValueError(f"overlap_prefill_decode: only corun mode has separate prefill and "
                             f"decode steps to overlap, got mode {self.kernel_mode.value!r}")
        if self.overlap_prefill_decode and self.tensor_parallel_size > 1:
            raise ValueError("overlap_prefill_decode: not supported with tensor_parallel_size "
                             f"{self.tensor_parallel_size} > 1 (collectives on two streams)")
        if not isinstance(self.enable_return_routed_experts, bool):
            raise ValueError(f"enable_return_routed_experts: expected a bool, "
                             f"got {self.enable_return_routed_experts!r}")
        if self.path_invariant is not None and not isinstance(self.path_invariant, bool):
            raise ValueError(f"path_invariant: expected None or a bool, "
                             f"got {self.path_invariant!r}")
        if self.path_invariant and self.kernel_mode is Mode.DEFAULT:
            raise ValueError("path_invariant: mode 'default' makes no promise of equal bits "
                             "(its decode splits follow the batch); use corun, "
                             "batch_invariant or batch_invariant_tuned")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching: expected a bool, "
                             f"got {self.enable_prefix_caching!r}")
        if isinstance(self.distributed_timeout_s, bool) or not isinstance(
                self.distributed_timeout_s, (int, float)) or not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s: expected a positive number of seconds, "
                             f"got {self.distributed_timeout_s!r}")

    # -- derived values --------------------------------------------------------------------------

    @property
    def kernel_mode(self) -> Mode:
        return Mode.parse(self.mode)

    @property
    def is_corun(self) -> bool:
        return self.kernel_mode is Mode.CORUN

    @property
    def is_batch_invariant(self) -> bool:
        return self.kernel_mode.is_batch_invariant

    @property
    def is_path_invariant(self) -> bool:
        """``path_invariant`` resolved: on by default in every mode but ``default``."""
        if self.kernel_mode is Mode.DEFAULT:
            return False
        return self.path_invariant is not False

    @property
    def num_decode_slots(self) -> int:
        """B: the fixed decode batch under corun."""
        return self.decode_batch_size or self.max_num_seqs

    @property
    def max_running_seqs(self) -> int:
        """Admission cap: sequences holding KV (prefilling, decoding or waiting for a slot)."""
        return self.max_num_seqs

    def _default_max_model_len(self) -> int:
        """DEFAULT_MAX_MODEL_LEN, or the positions the model serves when fewer (vLLM derives
        its default from the model too; a checkpoint whose config.json is unreadable keeps the
        constant, and building it reports why)."""
        from corun.memory_plan import model_config_of

        model_config = model_config_of(self.model)
        if model_config is None:
            return DEFAULT_MAX_MODEL_LEN
        return min(DEFAULT_MAX_MODEL_LEN, model_config.max_sequence_length)

    @property
    def prefill_alignment(self) -> int:
        """Token multiple at which a batch-invariant chunk may be cut: the Triton prefill
        attention kernel's query tile BLOCK_M (``kernels.attention.prefill_attention_config``:
        128 for 16-bit dtypes, 64 for fp32), within which a row's bits do not depend on the
        chunking. The torch backend attends one query at a time under batch_invariant, so any
        cut keeps its bits (1)."""
        if self.resolved_backend == "torch":
            return 1
        return 64 if self._dtype_name() == "float32" else 128

    @property
    def prefix_cache_granularity(self) -> int | None:
        """Token multiple a prefix-cache hit is rounded down to (None: caching off).

        A suffix prefilled after a cached prefix of P tokens must give exactly the rows of an
        uncached prefill, and the cached blocks must hold what the uncached run would write:

        - batch_invariant (and default): chunks may start anywhere the kernels keep a row's bits,
          i.e. at multiples of ``prefill_alignment`` (the Triton prefill tile; 1 on the torch
          backend, which attends one query at a time), so P = lcm(block_size, alignment).
        - corun, packed prefill on the Triton backend with C a multiple of the tile: the step's
          shapes are fixed (GEMMs at M = T) and attention is chunk-invariant at tile-aligned
          starts, so the shorter first chunk [P, next multiple of C) keeps every row's bits:
          lcm(block_size, alignment) again.
        - corun otherwise (isolated prefill pads a chunk to its own bucket, so a shorter chunk
          runs other GEMM shapes; the torch backend's corun attention multiplies a chunk's
          queries at once): the suffix must be cut exactly as uncached, so P is a multiple of
          C: lcm(block_size, C).
        """
        if not self.enable_prefix_caching:
            return None
        alignment = self.prefill_alignment
        unit = alignment
        if self.is_corun and not (self.is_packed_prefill and self.resolved_backend == "triton"
                                  and self.prefill_chunk_size % alignment == 0):
            unit = self.prefill_chunk_size
        return math.lcm(self.block_size, unit)

    @property
    def is_packed_prefill(self) -> bool:
        return self.is_corun and self.prefill_policy == "packed"

    @property
    def prefill_buckets(self) -> list[int]:
        """Token counts an isolated corun prefill step is padded to, ascending: powers of two
        from MIN_PREFILL_BUCKET up to the first that holds a chunk, and C itself."""
        size = self.prefill_chunk_size
        buckets, bucket = [], MIN_PREFILL_BUCKET
        while bucket < size:
            buckets.append(bucket)
            bucket *= 2
        return [*buckets, size]

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def decode_buckets(self) -> list[int]:
        """Decode batch sizes a step is padded to (and graphs captured at), ascending.

        corun: exactly [B]. Dynamic modes: 1, 2, 4, ... up to the first power of two that holds
        max_num_seqs (the last bucket is max_num_seqs itself when it is not a power of two).
        """
        if self.is_corun:
            return [self.num_decode_slots]
        buckets, size = [], 1
        while size < self.max_num_seqs:
            buckets.append(size)
            size *= 2
        return [*buckets, self.max_num_seqs]

    @property
    def dynamic_step_tokens(self) -> list[int]:
        """Token counts of the dynamic modes' padded prefill / mixed step shapes, ascending
        (``dynamic_graph_tokens`` resolved; empty under corun, whose steps are fixed anyway)."""
        if self.is_corun:
            return []
        if self.dynamic_graph_tokens is None:
            if not self.use_cuda_graphs:
                return []
            return [t for t in DYNAMIC_GRAPH_TOKENS if t <= self.max_num_batched_tokens]
        return sorted(set(self.dynamic_graph_tokens))

    def _dtype_name(self) -> str:
        value = self.dtype
        if value is None or value == "auto":
            return "bfloat16" if self.resolved_device.startswith("cuda") else "float32"
        if not isinstance(value, str):
            value = str(value).removeprefix("torch.")
        value = _DTYPE_ALIASES.get(value, value)
        if value not in _DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        return value

    @property
    def torch_dtype(self):  # -> torch.dtype; torch is imported lazily to keep this module light
        import torch

        return getattr(torch, self._dtype_name())

    @property
    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def is_cuda(self) -> bool:
        return self.resolved_device.startswith("cuda")

    @property
    def resolved_backend(self) -> str:
        return self.backend or ("triton" if self.is_cuda else "torch")

    @property
    def is_parallel(self) -> bool:
        return self.tensor_parallel_size > 1

    @property
    def distributed_backend(self) -> str:
        """The torch.distributed backend of tensor parallelism: NCCL on CUDA, gloo elsewhere."""
        return "nccl" if self.is_cuda else "gloo"

    @property
    def use_cuda_graphs(self) -> bool:
        return bool(self.cuda_graphs) and self.is_cuda


# Each field's default, for the places that show or fall back to it (the server's flags, the
# sweep's older records): read from the dataclass so they cannot drift from it.
ENGINE_DEFAULTS: dict[str, object] = {
    f.name: f.default for f in dataclasses.fields(EngineConfig)}
