"""Token sampling with request-bound noise, and per-token log-probabilities.

``sample(logits [B, V], temperature, top_k, top_p, seeds, sample_indices, positions) -> [B] int64``
draws by Gumbel-max, argmax(logits / T - log(-log u)) over the row's top-k/top-p set, with ``u``
from Philox4x32-10 keyed by the request seed and counted by (vocab index, position, sample index, 0)
(``sampling_uniform_reference``, bit for bit). Temperature 0 is greedy argmax (lowest id on ties).

The kept set is ``key >= threshold`` for the scaled logits' int order keys (fp32 bits, negative
patterns flipped), found without a sort:
- top-k keeps ``key >= t_k``, t_k the largest key whose count ``key >= t_k`` is >= k (the k-th
  largest value; ties at it are all kept, where the reference keeps the lowest ids);
- top-p keeps ``key >= t_p``, t_p the smallest key whose mass strictly above it (softmax over the
  top-k set) is < top_p: the reference's "smallest set whose mass reaches top_p, the crossing
  token kept", tie-free. Masses are fixed point (``int64(exp(s - s_max) * 2**40)`` per token, exact
  integer sums), so a row whose mass crosses top_p within ~1e-7 of a token may differ from the
  fp64 reference there.

Two launches, each row split over fixed pieces of CHUNK columns (a function of V only):
1. ``_sample_partial_kernel`` [B, V / (CHUNK * pieces per program)], each program reading one or
   (at large B) a few pieces, each reduced alone: greedy and temperature-only rows get the piece's
   argmax (of the logits, or of logits / T + Gumbel noise); top-k/top-p rows get the piece's
   *list*, its largest top set of at most R tokens (by a bisection in registers), with their
   Gumbel values, plus the piece's max, the mass of the rest and its completeness bound.
2. ``_sample_combine_kernel`` [B]: argmax over the pieces in piece order; or, for top-k/top-p, the
   thresholds by bisection over the lists and the draw there. The lists hold every token with key
   >= the largest bound, so whenever the kept set lies above it (every row whose kept set has no
   more than ~R tokens in any piece: k <= R always) the result is exact; other rows (large k, flat
   distributions under top-p) fall back to exact sweeps over their whole row in that program.

Invariance: every value a row's token depends on is computed from that row's own data in fixed
pieces and combined in a fixed order (ties to the lowest id, integer mass sums), and the config
reads only V (the batch size picks only how many pieces a program reads, never what a piece
computes); the noise is a function of the row's own (seed, position, sample index). A row's
token (and log-probability) depends only on its own inputs under every mode, whatever the batch,
the slot or the grid: batch- and position-invariant in ``default``, ``batch_invariant`` and
``corun``. Both launches are CUDA-graph capturable (no host sync, workspace sized by the shape).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels.mode import Mode
from kernels.sampling_kernels import (
    _sample_combine_kernel,
    _sample_partial_kernel,
    _token_logprobs_kernel,
    _uniform_kernel,
)
from kernels.utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    cdiv,
    check_same_device,
    check_shape,
    check_tensor,
    next_power_of_2,
)


@dataclass(frozen=True)
class SamplingConfig:
    """CHUNK: columns of a row per program of the first launch (the fixed pieces); R: candidate
    list size per piece; BLOCK_V: columns per step of the one-program-per-row sweeps (fallback,
    logprobs, noise) with their warps; warps of the two sampling launches; pieces_per_program:
    pieces one program of the first launch reads from ``group_from_batch`` rows on (the grid
    only: every piece is reduced alone, so no bits change with it)."""

    CHUNK: int
    R: int
    BLOCK_V: int
    sweep_warps: int
    num_warps: int
    combine_warps: int
    pieces_per_program: int = 1
    group_from_batch: int = 1

    def __post_init__(self) -> None:
        for name in ("CHUNK", "R", "BLOCK_V", "pieces_per_program"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"SamplingConfig.{name}: expected a power of 2, got {value}")


@functools.lru_cache(maxsize=64)
def sampling_config(vocab_size: int, dtype: torch.dtype, mode: Mode = Mode.CORUN) -> SamplingConfig:
    """Pure policy of V only (never the batch size: ``pieces_per_program`` reads B against
    ``group_from_batch``, and changes the grid, not the bits); the same for every mode, since
    the kernels are batch-invariant as they stand. Pieces of 1024 columns put 149 programs on a
    151936 row, more than the H200's 132 SMs at B = 1. From B = 64 on, a program reads 2 pieces:
    one 4 KB piece per program left greedy rows at B = 256 latency-bound, at half the HBM
    bandwidth; 2 pieces make them 1.28x faster there, while 4 or 8 slow the Gumbel and
    top-k/top-p rows down at B >= 64 (register pressure, pieces in series: up to 1.5x at 4
    pieces on 8 warps, 2.2x at 8 on 4; the sample_variant rows of kernels-h200.json)."""
    del dtype, mode
    chunk = min(next_power_of_2(vocab_size), 1024)
    r = min(32, chunk)
    num_chunks = cdiv(vocab_size, chunk)
    slots = next_power_of_2(num_chunks) * r
    block = min(next_power_of_2(vocab_size), 4096)
    return SamplingConfig(
        CHUNK=chunk,
        R=r,
        BLOCK_V=block,
        sweep_warps=4 if block <= 1024 else 8,  # token_logprobs' reduction order: keep as is
        num_warps=4,
        combine_warps=max(4, min(16, slots // 512)),
        pieces_per_program=2 if num_chunks >= 16 else 1,
        group_from_batch=64,
    )


def pieces_per_program(cfg: SamplingConfig, batch: int) -> int:
    """Pieces one program of the first launch reads at this batch size (the grid, not the bits)."""
    return cfg.pieces_per_program if batch >= cfg.group_from_batch else 1


def _check_logits(logits: object) -> tuple[int, int]:
    """[B, V] float logits with a non-empty vocab; returns (B, V)."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    batch, vocab = logits.shape
    if vocab == 0:
        raise ValueError("logits: expected a non-empty vocab dim")
    return batch, vocab


def _check_per_row(name: str, t: object, batch: int, dtypes: tuple[torch.dtype, ...],
                   contiguous: bool = True) -> None:
    """A [batch] tensor; contiguous unless the launcher copies it (kernels read ``ptr + row``)."""
    check_tensor(name, t, ndim=1, dtypes=dtypes, contiguous=contiguous)
    check_shape(name, t, (batch,))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    sample_indices: torch.Tensor,
    positions: torch.Tensor,
    *,
    mode: Mode = Mode.CORUN,
    config: SamplingConfig | None = None,
) -> torch.Tensor:
    """Sampled token ids [B] int64; ``sample_reference``'s draws (module docstring for ties).

    temperature [B] f32 (0 = greedy), top_k [B] int (<= 0 or >= V: off), top_p [B] f32 (1: off),
    seeds [B] int64, sample_indices [B] int, positions [B] int. Batch- and position-invariant under
    every mode. Values are not range-checked (that would synchronise the device). ``config``
    overrides the policy (tests: small pieces and lists reach the fallback path).
    """
    mode = Mode.parse(mode)
    batch, vocab = _check_logits(logits)
    _check_per_row("temperature", temperature, batch, (torch.float32,))
    _check_per_row("top_k", top_k, batch, INDEX_DTYPES)
    _check_per_row("top_p", top_p, batch, (torch.float32,))
    _check_per_row("seeds", seeds, batch, (torch.int64,))
    _check_per_row("sample_indices", sample_indices, batch, INDEX_DTYPES)
    _check_per_row("positions", positions, batch, INDEX_DTYPES)
    check_same_device(
        logits=logits,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seeds=seeds,
        sample_indices=sample_indices,
        positions=positions,
    )
    return _sample_launch(
        logits, temperature, top_k, top_p, seeds, sample_indices, positions,
        config or sampling_config(vocab, logits.dtype, mode),
    )[0]


def _sample_launch(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    sample_indices: torch.Tensor,
    positions: torch.Tensor,
    cfg: SamplingConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, path [B]) on checked arguments; path is 1 where a top-k/top-p row fell back to
    the whole-row sweeps, 0 where its candidate lists decided (undefined for other rows)."""
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out, out
    num_chunks = cdiv(vocab, cfg.CHUNK)
    num_parts = batch * num_chunks
    # Workspace, per part = (row, piece): f32 [argmax value | piece max | rest mass | R noisy
    # values], i32 [argmax id | list length | piece max key | R keys | R ids], i64 [bound].
    ws_f32 = torch.empty(num_parts * (3 + cfg.R), dtype=torch.float32, device=logits.device)
    ws_i32 = torch.empty(num_parts * (3 + 2 * cfg.R), dtype=torch.int32, device=logits.device)
    ws_i64 = torch.empty(num_parts, dtype=torch.int64, device=logits.device)
    args = (logits, temperature, top_k, top_p, seeds, sample_indices, positions,
            ws_f32, ws_i32, ws_i64)
    pieces = pieces_per_program(cfg, batch)
    _sample_partial_kernel[(batch, cdiv(num_chunks, pieces))](
        *args, vocab, num_chunks, num_parts, logits.stride(0),
        CHUNK=cfg.CHUNK, R=cfg.R, PIECES=pieces, num_warps=cfg.num_warps,
    )
    _sample_combine_kernel[(batch,)](
        *args, out, vocab, num_chunks, num_parts, logits.stride(0),
        R=cfg.R, CHUNKS_POW2=next_power_of_2(num_chunks), BLOCK_F=cfg.BLOCK_V,
        num_warps=cfg.combine_warps,
    )
    return out, ws_i64.view(batch, num_chunks)[:, 0]


def sampling_uniform(
    seeds: torch.Tensor, sample_indices: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """The noise ``sample`` draws with, [B, V] fp32: ``sampling_uniform_reference`` bit for bit."""
    check_tensor("seeds", seeds, ndim=1, dtypes=(torch.int64,), contiguous=True)
    batch = seeds.shape[0]
    _check_per_row("sample_indices", sample_indices, batch, INDEX_DTYPES)
    _check_per_row("positions", positions, batch, INDEX_DTYPES)
    check_same_device(seeds=seeds, sample_indices=sample_indices, positions=positions)
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size: expected a positive int, got {vocab_size!r}")
    out = torch.empty((batch, vocab_size), dtype=torch.float32, device=seeds.device)
    if batch == 0:
        return out
    cfg = sampling_config(vocab_size, torch.float32)
    _uniform_kernel[(batch, cdiv(vocab_size, cfg.BLOCK_V))](
        seeds,
        sample_indices,
        positions,
        out,
        vocab_size,
        BLOCK_V=cfg.BLOCK_V,
        num_warps=cfg.sweep_warps,
    )
    return out


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, *, mode: Mode = Mode.CORUN
) -> torch.Tensor:
    """log_softmax(logits[b])[token_ids[b]] in fp32: [B] for ids [B], [B, K] for ids [B, K] (the
    K ids of a row share its one logsumexp); an id outside [0, V) gives NaN.

    Batch- and position-invariant under every mode (one program per row, fixed block order).
    """
    mode = Mode.parse(mode)
    batch, vocab = _check_logits(logits)
    if isinstance(token_ids, torch.Tensor) and token_ids.ndim == 2:
        check_tensor("token_ids", token_ids, ndim=2, dtypes=INDEX_DTYPES)
        if token_ids.shape[0] != batch:
            raise ValueError(f"token_ids: expected {batch} rows, got {token_ids.shape[0]}")
        num_ids = token_ids.shape[1]
    else:
        _check_per_row("token_ids", token_ids, batch, INDEX_DTYPES, contiguous=False)
        num_ids = 1
    check_same_device(logits=logits, token_ids=token_ids)
    out = torch.empty(token_ids.shape, dtype=torch.float32, device=logits.device)
    if batch == 0 or num_ids == 0:
        return out
    cfg = sampling_config(vocab, logits.dtype, mode)
    _token_logprobs_kernel[(batch,)](
        logits,
        token_ids.contiguous(),
        out,
        vocab,
        num_ids,
        logits.stride(0),
        BLOCK_V=cfg.BLOCK_V,
        num_warps=cfg.sweep_warps,
    )
    return out
