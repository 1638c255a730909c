"""The ops of ``experiments.invariance_atlas``: ours in each policy and the vendor ones, as cases.

A case computes a batch of independent *rows* (tokens for the GEMM, norm, RoPE, MoE and
sampling; sequences for attention): ``run(ids)`` returns one output tensor per row, and row i's
input is drawn from ``ids[i]`` alone (``Bank``), so the same id gives the same row data whatever
batch, slot or co-runners it sits with. The atlas then varies exactly one of those around a fixed
row.

Shapes (``REAL``): Qwen3-8B (hidden 4096, 32 q / 8 kv heads of 128, vocab 151936, the down
projection 12288 -> 4096) in bf16; the MoE at Qwen3-235B-A22B's layer (128 experts, top-8,
hidden 4096, expert width 1536). ``TINY``: the same ops at CPU-interpreter sizes in fp32 (the
interpreter's bf16 ``tl.dot`` is wrong, DESIGN.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

POLICIES = ("default", "batch_invariant", "batch_invariant_tuned", "corun")
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")

REAL = dict(dtype=torch.bfloat16, hidden=4096, gemm_n=4096, gemm_k=12288, inter=12288,
            q_heads=32, kv_heads=8, head_dim=128, vocab=151936, moe_model="qwen3-235b-a22b",
            block=16, decode_len=3000, max_len=8192, prefill_len=1024, sdpa_len=4096,
            sdpa_prefill_len=2048,  # the math backend materialises B x 32 x L x L scores
            batch=256, sizes=(1, 2, 8, 32, 64, 128, 512, 2048),
            attn_batch=16, attn_sizes=(1, 2, 4, 8, 16, 32, 64),
            prefill_batch=8, prefill_sizes=(1, 2, 4, 8, 16), sample_batch=64,
            sample_sizes=(1, 2, 8, 32, 64, 256))
TINY = dict(dtype=torch.float32, hidden=64, gemm_n=32, gemm_k=64, inter=64, q_heads=4,
            kv_heads=2, head_dim=16, vocab=256, moe_model="tiny-qwen3-moe", block=16,
            decode_len=40, max_len=128, prefill_len=32, sdpa_len=32, sdpa_prefill_len=32,
            batch=4, sizes=(1, 2, 4),
            attn_batch=3, attn_sizes=(1, 2, 3), prefill_batch=2, prefill_sizes=(1, 2),
            sample_batch=3, sample_sizes=(1, 3))


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    impl: str  # "triton (ours)", "cuBLAS", "sdpa FLASH_ATTENTION", ...
    policy: str  # our Mode, or "vendor"
    shape: str
    batch: int  # the fixed batch of checks (a), (b) and (d)
    sizes: tuple[int, ...]  # the batch sizes of check (c)
    run: Callable[[list[int]], list[torch.Tensor]]


class Bank:
    """Row data keyed by (what, id): drawn once from a generator seeded by both, then reused."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self._rows: dict[tuple, torch.Tensor] = {}

    def row(self, what: str, i: int, shape: tuple[int, ...], dtype=None) -> torch.Tensor:
        key = (what, i, shape)
        if key not in self._rows:
            seed = (sum(map(ord, what)) * 1_000_003 + i) % 2**62
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self._rows[key] = torch.randn(shape, generator=gen, device=self.device).to(
                dtype or self.dtype)
        return self._rows[key]

    def rows(self, what: str, ids: list[int], shape: tuple[int, ...], dtype=None):
        return torch.stack([self.row(what, i, shape, dtype) for i in ids])

    def weight(self, what: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.row(what, -1, shape) * shape[-1] ** -0.5


def _length(i: int, top: int) -> int:
    """A row's own sequence length, a function of its id (id 0: the row under test)."""
    return (i * 7919) % top + 1


def gemm_cases(bank: Bank, s: dict) -> list[Case]:
    from kernels.gemm import gemm

    n, k = s["gemm_n"], s["gemm_k"]
    w = bank.weight("w", (n, k))
    shape = f"x[M, {k}] @ W[{n}, {k}].T"

    def ours(mode):
        return lambda ids: list(gemm(bank.rows("x", ids, (k,)), w, mode=mode))

    cases = [Case("gemm", "triton (ours)", m, shape, s["batch"], s["sizes"], ours(m))
             for m in POLICIES]
    return [Case("gemm", "cuBLAS / torch.matmul", "vendor", shape, s["batch"], s["sizes"],
                 lambda ids: list(bank.rows("x", ids, (k,)) @ w.T)), *cases]


def elementwise_cases(bank: Bank, s: dict) -> list[Case]:
    from kernels.activation import silu_mul
    from kernels.norm import rmsnorm
    from kernels.rope import build_rope_cache, rope

    h, inter, b, sizes = s["hidden"], s["inter"], s["batch"], s["sizes"]
    weight = bank.row("norm_w", 0, (h,))
    x = lambda ids: bank.rows("x_norm", ids, (h,))  # noqa: E731
    cases = [Case("rmsnorm", "torch F.rms_norm", "vendor", f"[M, {h}]", b, sizes,
                  lambda ids: list(F.rms_norm(x(ids), (h,), weight, 1e-6))),
             Case("softmax", "torch.softmax (fp32)", "vendor", f"[M, {s['vocab']}]",
                  s["sample_batch"], s["sample_sizes"], lambda ids: list(torch.softmax(
                      bank.rows("logits", ids, (s["vocab"],), torch.float32), -1))),
             Case("silu_mul", "torch F.silu(g) * u", "vendor", f"[M, 2 x {inter}]", b, sizes,
                  lambda ids: list(F.silu(bank.rows("gu", ids, (inter,))) * bank.rows(
                      "gu2", ids, (inter,))))]
    qh, kh, d = s["q_heads"], s["kv_heads"], s["head_dim"]
    cache = build_rope_cache(d, s["max_len"], 1e6, dtype=torch.float32, device=bank.device)

    def rope_rows(ids, mode):
        pos = torch.tensor([_length(i, s["max_len"]) - 1 for i in ids], device=bank.device)
        q, k = rope(bank.rows("q_rope", ids, (qh, d)), bank.rows("k_rope", ids, (kh, d)), pos,
                    cache, True, mode=mode)
        return [torch.cat([a.flatten(), c.flatten()]) for a, c in zip(q, k, strict=True)]

    for mode in POLICIES:
        cases += [
            Case("rmsnorm", "triton (ours)", mode, f"[M, {h}]", b, sizes,
                 lambda ids, m=mode: list(rmsnorm(x(ids), weight, 1e-6, mode=m))),
            Case("silu_mul", "triton (ours)", mode, f"[M, 2 x {inter}]", b, sizes,
                 lambda ids, m=mode: list(silu_mul(torch.cat(
                     [bank.rows("gu", ids, (inter,)), bank.rows("gu2", ids, (inter,))], -1),
                     mode=m))),
            Case("rope", "triton (ours)", mode, f"q[M, {qh}, {d}], k[M, {kh}, {d}], NeoX", b,
                 sizes, lambda ids, m=mode: rope_rows(ids, m))]
    return cases


def sampling_cases(bank: Bank, s: dict) -> list[Case]:
    from kernels.sampling import sample, token_logprobs

    v, dev = s["vocab"], bank.device

    def run(ids, mode):
        logits = bank.rows("logits", ids, (v,), torch.float32)
        n = len(ids)
        tokens = sample(logits, torch.ones(n, device=dev), torch.full((n,), 50, device=dev),
                        torch.full((n,), 0.9, device=dev),
                        torch.tensor([i + 1 for i in ids], device=dev),
                        torch.zeros(n, dtype=torch.int64, device=dev),
                        torch.tensor(ids, device=dev), mode=mode)
        logprobs = token_logprobs(logits, tokens, mode=mode)
        return [torch.stack([t.double(), lp.double()]) for t, lp in zip(tokens, logprobs,
                                                                         strict=True)]

    return [Case("sample + token_logprobs", "triton (ours)", m,
                 f"logits[M, {v}] fp32, T=1 top-k 50 top-p 0.9", s["sample_batch"],
                 s["sample_sizes"], lambda ids, m=m: run(ids, m)) for m in POLICIES]


def _paged(bank: Bank, ids: list[int], lens: list[int], s: dict):
    """K/V caches holding each row's own K/V (drawn from its id) in scattered blocks."""
    blk, kh, d = s["block"], s["kv_heads"], s["head_dim"]
    blocks = [-(-n // blk) for n in lens]
    total = sum(blocks)
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(len(ids) + sum(ids)))
    tables = torch.zeros((len(ids), max(blocks)), dtype=torch.int32)
    kc = torch.zeros((total, blk, kh, d), dtype=bank.dtype, device=bank.device)
    vc = torch.zeros_like(kc)
    start = 0
    for r, (i, n, nb) in enumerate(zip(ids, lens, blocks, strict=True)):
        tables[r, :nb] = perm[start:start + nb].to(torch.int32)
        start += nb
        tok = torch.arange(n)
        slots = (tables[r, tok // blk].long() * blk + tok % blk).to(bank.device)
        kc.view(-1, kh, d)[slots] = bank.row("k", i, (n, kh, d))
        vc.view(-1, kh, d)[slots] = bank.row("v", i, (n, kh, d))
    return kc, vc, tables.to(bank.device)


def attention_cases(bank: Bank, s: dict) -> list[Case]:
    from kernels.attention import decode_attention, prefill_attention

    qh, kh, d, dev = s["q_heads"], s["kv_heads"], s["head_dim"], bank.device
    scale = d**-0.5
    own_len = {"decode": s["decode_len"], "prefill": s["prefill_len"]}

    def lens(ids, kind, top):
        return [own_len[kind] if i == 0 else _length(i, top) for i in ids]

    def decode(ids, mode, fused_combine=False):
        ls = lens(ids, "decode", s["max_len"])
        kc, vc, tables = _paged(bank, ids, ls, s)
        bound = max(ls) if mode == "default" else s["max_len"]  # as the engine passes it
        out = decode_attention(bank.rows("q", ids, (qh, d)), kc, vc, tables,
                               torch.tensor(ls, dtype=torch.int32, device=dev), scale,
                               max_seq_len=bound, mode=mode, fused_combine=fused_combine)
        return list(out)

    def prefill(ids, mode):
        ls = lens(ids, "prefill", 2 * s["prefill_len"])
        kc, vc, tables = _paged(bank, ids, ls, s)
        q = torch.cat([bank.row("qp", i, (n, qh, d)) for i, n in zip(ids, ls, strict=True)])
        cu = torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32,
                          device=dev)
        out = prefill_attention(q, kc, vc, tables, cu, torch.tensor(ls, dtype=torch.int32,
                                device=dev), scale, max_q_len=max(ls), mode=mode)
        return list(out.split(ls))

    heads = f"Hq {qh}, Hkv {kh}, D {d}"
    cases = []
    for mode in POLICIES:
        cases += [
            Case("decode_attention", "triton (ours)", mode,
                 f"{heads}, own len {s['decode_len']}, others 1..{s['max_len']}",
                 s["attn_batch"], s["attn_sizes"], lambda ids, m=mode: decode(ids, m)),
            Case("prefill_attention", "triton (ours)", mode,
                 f"{heads}, own len {s['prefill_len']}, varlen",
                 s["prefill_batch"], s["prefill_sizes"], lambda ids, m=mode: prefill(ids, m))]
    # The one-launch combine (the last lane of each sequence combines; atomics count arrivals):
    # the same bits as the two launches is the claim, run to run (d) included.
    cases.append(Case("decode_attention", "triton (ours, fused combine)", "corun",
                      f"{heads}, own len {s['decode_len']}, others 1..{s['max_len']}",
                      s["attn_batch"], s["attn_sizes"],
                      lambda ids: decode(ids, "corun", fused_combine=True)))
    return _sdpa_cases(bank, s) + cases


def _sdpa_cases(bank: Bank, s: dict) -> list[Case]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qh, kh, d = s["q_heads"], s["kv_heads"], s["head_dim"]
    group = qh // kh

    def run(ids, backend, decode):
        n = s["sdpa_len"] if decode else s["sdpa_prefill_len"]
        q = bank.rows("sq", ids, (qh, 1 if decode else n, d))
        k = bank.rows("sk", ids, (kh, n, d)).repeat_interleave(group, 1)
        v = bank.rows("sv", ids, (kh, n, d)).repeat_interleave(group, 1)
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return list(F.scaled_dot_product_attention(q, k, v, is_causal=not decode))

    cases = []
    for backend in SDPA_BACKENDS:
        cases += [
            Case("decode_attention", f"sdpa {backend}", "vendor",
                 f"q len 1, kv {s['sdpa_len']}, {qh} heads (K/V repeated from {kh}), D {d}",
                 s["attn_batch"], s["attn_sizes"], lambda ids, b=backend: run(ids, b, True)),
            Case("prefill_attention", f"sdpa {backend}", "vendor",
                 f"causal, len {s['sdpa_prefill_len']}, {qh} heads (K/V repeated from {kh}), "
                 f"D {d}",
                 s["prefill_batch"], s["prefill_sizes"],
                 lambda ids, b=backend: run(ids, b, False))]
    return cases


def moe_cases(bank: Bank, s: dict) -> list[Case]:
    from experiments.bench_moe import _shapes, torch_moe_layer
    from kernels.moe import fused_moe
    from kernels.moe_routing import softmax_topk

    sh = _shapes(s["moe_model"])
    e, h, i, k = sh["num_experts"], sh["hidden"], sh["inter"], sh["top_k"]
    w13, w2 = bank.weight("w13", (e, 2 * i, h)), bank.weight("w2", (e, h, i))

    def inputs(ids):
        return bank.rows("xm", ids, (h,)), bank.rows("router", ids, (e,))

    def ours(ids, mode):
        x, logits = inputs(ids)
        weights, top = softmax_topk(logits, k, sh["renormalize"], mode=mode)
        return list(fused_moe(x, w13, w2, weights, top, mode=mode, check_ids=False))

    shape = f"{e} experts top-{k}, H {h}, I {i} ({s['moe_model']})"
    return [Case("moe", "torch expert loop (index_add_)", "vendor", shape, s["batch"],
                 s["sizes"], lambda ids: list(torch_moe_layer(sh, *inputs(ids), w13, w2, None))),
            *[Case("moe", "triton (ours)", m, shape, s["batch"], s["sizes"],
                   lambda ids, m=m: ours(ids, m)) for m in POLICIES]]


def all_cases(device: torch.device, tiny: bool) -> list[Case]:
    s = TINY if tiny else REAL
    bank = Bank(device, s["dtype"])
    return [*gemm_cases(bank, s), *elementwise_cases(bank, s), *attention_cases(bank, s),
            *moe_cases(bank, s), *sampling_cases(bank, s)]
