"""The explicit carriers of per-step metadata from the engine into a model.

``ForwardBatch`` is the only way attention metadata reaches the layers: no module globals, no
attributes patched onto layers. The CUDA-graph runner captures with a ForwardBatch whose tensors
*are* its static buffers and replays after copying the next step's values into them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kernels.mode import Mode

Backend = Literal["triton", "torch"]


@dataclass(frozen=True)
class OpsConfig:
    """How the layers compute: which kernel policy (mode) and which implementation.

    ``backend="triton"`` runs every op through ``kernels/``; ``backend="torch"`` runs the plain
    torch path in ``models/ops.py`` (the CPU engine in CI uses it: position-invariant at a fixed
    shape, and batch-invariant under ``Mode.BATCH_INVARIANT`` by computing in fixed row tiles).

    ``path_invariant`` (any mode but ``default``): a token's rows have the same bits whichever
    path computes them, a decode step or a prefill chunk: the GEMM-like kernels keep a row's bits
    at every M (``gemm_mode``) and prefill attention folds each row's keys in the decode's splits
    (``prefill_split_size``). Off, corun's GEMMs may pick split-K from M and prefill attention
    runs each row as one split: only the decode and prefill paths differ, each stays
    deterministic.
    """

    mode: Mode = Mode.CORUN
    backend: Backend = "triton"
    # Decode attention split size in tokens (corun / batch_invariant), DESIGN.md section 3.
    decode_split_size: int = 256
    # Decode attention combines the splits in its split launch (same bits, one launch fewer).
    decode_fused_combine: bool = False
    path_invariant: bool = True
    # A trainer's forward (corun.training): under autograd every op records the gradient of its
    # torch reference (models/differentiable.py); its outputs are still the kernels'.
    differentiable: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.mode, Mode):
            raise TypeError(f"mode: expected a kernels.Mode, got {type(self.mode).__name__}")
        if self.backend not in ("triton", "torch"):
            raise ValueError(f"backend: expected 'triton' or 'torch', got {self.backend!r}")
        # The decode attention kernels tile a split in 16-, 32- or 64-token KV blocks.
        split = self.decode_split_size
        if isinstance(split, bool) or not isinstance(split, int) or split < 16 or split % 16:
            raise ValueError(
                f"decode_split_size: expected a positive multiple of 16, got {split!r}")
        if not isinstance(self.decode_fused_combine, bool):
            raise TypeError(f"decode_fused_combine: expected a bool, "
                            f"got {type(self.decode_fused_combine).__name__}")
        for name in ("path_invariant", "differentiable"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, "
                                f"got {type(getattr(self, name)).__name__}")

    @property
    def is_path_invariant(self) -> bool:
        """Whether decode and prefill rows of one token have the same bits (never under
        ``default``, whose decode splits follow the batch)."""
        return self.path_invariant and self.mode is not Mode.DEFAULT

    @property
    def gemm_mode(self) -> Mode:
        """The policy of the kernels whose rows could change with M (GEMMs, MLA's per-head
        products, MoE expert GEMMs). Under path invariance corun's take the tuned batch-invariant
        policy (tiles per shape, never split-K: a row's bits the same at the decode's M and the
        prefill's); otherwise the mode itself."""
        if self.mode is Mode.CORUN and self.path_invariant:
            return Mode.BATCH_INVARIANT_TUNED
        return self.mode

    @property
    def prefill_split_size(self) -> int | None:
        """The split size prefill attention folds each row's keys in: the decode's under path
        invariance, else None (one split a row)."""
        return self.decode_split_size if self.is_path_invariant else None


@dataclass
class ForwardBatch:
    """One model step over a flat token batch.

    Prefill (``is_prefill``): the tokens of each sequence's chunk back to back; ``cu_seqlens_q``
    [B + 1] delimits them, ``context_lens`` [B] is each sequence's total length including the
    chunk, ``max_q_len`` the longest chunk (host int). The chunk's K/V are written at
    ``slot_mapping`` before attention reads the cache.

    Decode: one token per slot; ``seq_lens`` [B] (including the new token; 0 for a padded dummy
    slot, whose ``slot_mapping`` is -1 and whose output is ignored). ``max_seq_len`` (host int) is
    the grid bound for decode attention: ``max_model_len`` under corun / batch_invariant (the
    launch shape must not change with the batch), the batch's longest under default.

    Mixed prefill + decode (``is_prefill`` with ``num_decode_tokens`` = nd > 0, the dynamic
    schedules): the first nd tokens are the decode tokens of the first nd sequences, then the
    prefill chunks. ``block_tables`` rows [0, nd) are the decode sequences', rows [nd, ...) the
    chunks'; ``seq_lens`` [nd] and ``max_seq_len`` describe the decode part as in a decode step;
    ``cu_seqlens_q`` (from 0), ``context_lens`` and ``max_q_len`` describe the prefill part only.
    Attention runs ``decode_part()`` through the decode path and ``prefill_part()`` through the
    prefill path, so a decode token gets the bits of a pure decode step under corun and
    batch_invariant whatever prefill chunks share its step (as vLLM / SGLang backends split).

    ``token_mask`` [T] bool marks real tokens (False for dummies) so MoE routing can skip them.

    ``decode_arrivals`` (int32 zeros, held by the step buffers that bound the batch: one per
    stream of steps) is decode attention's per-(sequence, kv head) arrival count when
    ``ops.decode_fused_combine``; every call leaves it at zero, so one buffer serves every layer
    and step (None: the kernel allocates zeros per call).

    Packed prefill (corun): ``T`` tokens in ``R`` chunk rows, fixed; real chunks first, then
    zero-length rows (their ``cu_seqlens_q`` entries repeat, ``context_lens`` 0) and trailing
    dummy tokens past ``cu_seqlens_q[-1]`` (slot -1, mask False): kernels skip both, so every
    real row sees exactly the shapes of the step whoever else fills it.
    """

    is_prefill: bool
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, -1 = do not write
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32
    kv_cache: KVCache
    ops: OpsConfig
    cu_seqlens_q: torch.Tensor | None = None  # prefill: [B + 1] int32
    context_lens: torch.Tensor | None = None  # prefill: [B] int32
    max_q_len: int = 0
    seq_lens: torch.Tensor | None = None  # decode: [B] int32
    max_seq_len: int = 0
    token_mask: torch.Tensor | None = None  # [T] bool
    num_decode_tokens: int = 0  # mixed prefill: decode tokens first (see the class docstring)
    # Prefill: ``context_lens`` as host ints, real chunk rows only (padding rows of a packed step
    # have length 0 and are left out). Layers that size work by a sequence's context (MLA's
    # expansion) read these instead of syncing the device; None under a CUDA graph capture.
    context_lens_host: tuple[int, ...] | None = None
    decode_arrivals: torch.Tensor | None = None
    # Routing replay (corun.routed_experts.RoutedExperts): MoE layers record their top-k ids at
    # ``slot_mapping``; None when the engine does not return routed experts.
    routed_experts: object | None = None

    def __post_init__(self) -> None:
        # Shapes only (no tensor values): a check must not sync the device.
        nd = self.num_decode_tokens
        if nd == 0:
            return
        if not self.is_prefill or nd < 0 or nd > self.num_tokens:
            raise ValueError(f"num_decode_tokens: expected 0, or 1..{self.num_tokens} in a "
                             f"prefill batch, got {nd} (is_prefill={self.is_prefill})")
        if self.seq_lens is None or self.seq_lens.shape != (nd,):
            got = None if self.seq_lens is None else tuple(self.seq_lens.shape)
            raise ValueError(f"seq_lens: expected shape ({nd},) for {nd} decode tokens, got {got}")
        if self.context_lens is None or self.cu_seqlens_q is None:
            raise ValueError("context_lens: a mixed batch needs cu_seqlens_q and context_lens")
        num_chunks = self.context_lens.shape[0]
        if self.block_tables.shape[0] != nd + num_chunks:
            raise ValueError(f"block_tables: expected {nd} decode + {num_chunks} prefill rows, "
                             f"got {self.block_tables.shape[0]}")

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    def decode_part(self) -> ForwardBatch:
        """The decode tokens of a mixed batch as a decode batch (views, no copies)."""
        nd = self.num_decode_tokens
        return ForwardBatch(
            is_prefill=False, positions=self.positions[:nd], slot_mapping=self.slot_mapping[:nd],
            block_tables=self.block_tables[:nd], kv_cache=self.kv_cache, ops=self.ops,
            seq_lens=self.seq_lens, max_seq_len=self.max_seq_len,
            token_mask=None if self.token_mask is None else self.token_mask[:nd],
            decode_arrivals=self.decode_arrivals)

    def per_token_decode(self) -> ForwardBatch:
        """A prefill batch's tokens as a decode batch, one "sequence" per token: token i of a
        chunk attends to its own causal prefix (``seq_lens`` = its position + 1) through its
        sequence's block table; the padding tokens of a packed step get length 0 (zeros). What a
        prefill computes with the decode kernels, so each row has its decode's bits. Device ops
        only (no host sync)."""
        cu = self.cu_seqlens_q.long()
        num_seqs, num_tokens = cu.numel() - 1, self.num_tokens
        # Tokens after cu_seqlens_q[-1] (a packed step's padding) form an extra "sequence".
        q_lens = torch.cat([cu[1:] - cu[:-1], num_tokens - cu[-1:]])
        seq_of_token = torch.repeat_interleave(
            torch.arange(num_seqs + 1, device=cu.device), q_lens, output_size=num_tokens)
        padding = seq_of_token == num_seqs
        seq_lens = torch.where(padding, 0, self.positions + 1).to(torch.int32)
        tables = self.block_tables[seq_of_token.clamp(max=max(num_seqs - 1, 0))]
        return ForwardBatch(
            is_prefill=False, positions=self.positions, slot_mapping=self.slot_mapping,
            block_tables=tables, kv_cache=self.kv_cache, ops=self.ops, seq_lens=seq_lens,
            max_seq_len=self.max_seq_len, token_mask=self.token_mask)

    def prefill_part(self) -> ForwardBatch:
        """The prefill chunks of a mixed batch as a prefill batch (views, no copies)."""
        nd = self.num_decode_tokens
        return ForwardBatch(
            is_prefill=True, positions=self.positions[nd:], slot_mapping=self.slot_mapping[nd:],
            block_tables=self.block_tables[nd:], kv_cache=self.kv_cache, ops=self.ops,
            cu_seqlens_q=self.cu_seqlens_q, context_lens=self.context_lens,
            max_q_len=self.max_q_len, max_seq_len=self.max_seq_len,
            token_mask=None if self.token_mask is None else self.token_mask[nd:],
            context_lens_host=self.context_lens_host)


@dataclass(frozen=True)
class KVCacheSpec:
    """What one model needs cached per token per layer.

    ``kind="mha"``: a K and a V tensor per layer, ``[num_blocks, block_size, num_kv_heads,
    head_dim]``. ``kind="mla"``: one tensor per layer, ``[num_blocks, block_size, entry_dim]``
    with entry_dim = kv_lora_rank + qk_rope_head_dim (the compressed latent and the roped k_pe).
    """

    kind: Literal["mha", "mla"]
    num_layers: int
    num_kv_heads: int = 0
    head_dim: int = 0
    entry_dim: int = 0

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        per_token = 2 * self.num_kv_heads * self.head_dim if self.kind == "mha" else self.entry_dim
        return self.num_layers * block_size * per_token * elem


class KVCache:
    """The paged KV storage of one model: per-layer tensors, handed to layers by index."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: expected >= 1, got {num_blocks}")
        self.spec, self.num_blocks, self.block_size, self.dtype = (
            spec,
            num_blocks,
            block_size,
            dtype,
        )
        if spec.kind == "mha":
            shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        else:
            shape = (spec.num_layers, num_blocks, block_size, spec.entry_dim)
        # One allocation for all layers; zeros so a never-written slot can not hold NaNs.
        self.storage = torch.zeros(shape, dtype=dtype, device=device)

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of an MHA layer."""
        return self.storage[layer, 0], self.storage[layer, 1]

    def latent(self, layer: int) -> torch.Tensor:
        """The MLA cache of a layer, [num_blocks, block_size, entry_dim]."""
        return self.storage[layer]
