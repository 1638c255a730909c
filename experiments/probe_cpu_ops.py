"""Probe the CPU torch backend (``models.ops``, backend "torch") for position and batch variance.

For each op and mode, a batch of T copies of one random item (a row, a token, a sequence) is run
at T = 1..40 and a few larger T, at several intra-op thread counts. A row that differs from row 0
of the same call is *position-variant* (its bits depend on its slot); row 0 differing from the
T = 1 result is *T-variant* (batch-variant). corun must show no position variance, batch_invariant
neither. Plain torch calls (``plain-*``) are probed beside the ops they replace.

    python -m experiments.probe_cpu_ops [--threads 1,2,8] [--items 12] [--ops linear,sigmoid]

Prints one line per (op, mode): how many (threads, T, item) cases were position- or T-variant and
the first few. No GPU, no files written. What it found on AVX-512 (torch 2.13, 2 cores) is in the
models/ops.py and kernels/reference.py comments.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.mode import Mode
from kernels.rope import build_rope_cache
from models import ops
from models.forward_batch import ForwardBatch, OpsConfig

T_VALUES = list(range(1, 41)) + [64, 100, 257, 601]
H, E, HEADS, D = 64, 8, 4, 16


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weights() -> dict[str, torch.Tensor]:
    return dict(w=torch.randn(96, H, generator=_g(1)) / 8, norm=1 + 0.1 * torch.randn(H),
                bmm=torch.randn(HEADS, 32, D, generator=_g(2)),
                w13=torch.randn(E, 64, H, generator=_g(3)) / 8,
                w2=torch.randn(E, H, 32, generator=_g(4)) / 6,
                bias=torch.linspace(0, 0.1, E), rope=build_rope_cache(D, 64, 10000.0),
                k_cache=torch.randn(4, 4, 2, D, generator=_g(5)),
                v_cache=torch.randn(4, 4, 2, D, generator=_g(6)))


def _decode(q: torch.Tensor, w: dict, o: OpsConfig) -> torch.Tensor:
    t = q.shape[0]
    batch = ForwardBatch(is_prefill=False, positions=torch.full((t,), 12),
                         slot_mapping=torch.full((t,), -1), block_tables=torch.arange(
                             4, dtype=torch.int32).expand(t, 4), kv_cache=None, ops=o,
                         seq_lens=torch.full((t,), 13, dtype=torch.int32), max_seq_len=16)
    return ops.decode_attention(q, w["k_cache"], w["v_cache"], batch, 0.25).flatten(1)


# op name -> (item width, f(batch [T, width], weights, ops) -> per-row outputs [T, ...])
OPS: dict[str, tuple[int, Callable]] = {
    "linear": (H, lambda x, w, o: ops.linear(x, w["w"], o)),
    "plain-linear": (H, lambda x, w, o: F.linear(x, w["w"])),
    "bmm": (HEADS * D, lambda x, w, o: ops.bmm(x.view(-1, HEADS, D).transpose(0, 1).contiguous(),
                                              w["bmm"], o).transpose(0, 1).flatten(1)),
    "rmsnorm": (H, lambda x, w, o: ops.rmsnorm(x, w["norm"], 1e-6, o)),
    "silu_mul": (2 * H, lambda x, w, o: ops.silu_mul(x * 3, o)),
    "plain-silu": (40, lambda x, w, o: F.silu(x * 3)),  # a width with a SIMD tail
    "rope": (HEADS * D, lambda x, w, o: torch.cat([t.flatten(1) for t in ops.rope(
        x.view(-1, HEADS, D), x.view(-1, HEADS, D)[:, :1], torch.full((x.shape[0],), 9),
        w["rope"], False, o)], 1)),
    "softmax_topk": (E, lambda x, w, o: torch.cat(
        [t.float() for t in ops.softmax_topk(x * 2, 2, True, o)], 1)),
    "grouped_topk": (E, lambda x, w, o: torch.cat(
        [t.float() for t in ops.grouped_topk(x * 2, w["bias"], 2, 4, 2, True, 2.5, o)], 1)),
    "plain-sigmoid": (E, lambda x, w, o: torch.sigmoid(x * 2)),
    "log_softmax": (256, lambda x, w, o: torch.log_softmax(x * 3, -1)),
    "fused_moe": (H + E, lambda x, w, o: ops.fused_moe(
        x[:, :H].contiguous(), w["w13"], w["w2"],
        *ops.softmax_topk(x[:, H:].contiguous(), 2, True, o), o)),
    "decode_attention": (HEADS * D, lambda x, w, o: _decode(x.view(-1, HEADS, D), w, o)),
}


def probe(name: str, threads: list[int], items: int) -> None:
    width, fn = OPS[name]
    weights = _weights()
    for mode in Mode:
        o = OpsConfig(mode=mode, backend="torch")
        position, batch = [], []
        for num_threads in threads:
            torch.set_num_threads(num_threads)
            for item in range(items):
                row = torch.randn(1, width, generator=_g(100 + item))
                alone = fn(row, weights, o)[0]
                for t in T_VALUES:
                    out = fn(row.expand(t, width).contiguous(), weights, o)
                    moved = (out != out[0]).flatten(1).any(1).nonzero().flatten()
                    if moved.numel():
                        position.append((num_threads, t, int(moved[0])))
                    if not torch.equal(out[0], alone):
                        batch.append((num_threads, t))
        print(f"{name:17s} {mode.value:16s} position-variant {len(position):4d} {position[:4]}"
              f" | T-variant {len(batch):4d} {batch[:4]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2,8", help="intra-op thread counts")
    parser.add_argument("--items", type=int, default=12, help="random items per op")
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated op names")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    before = torch.get_num_threads()
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for name in args.ops.split(","):
        probe(name, threads, args.items)
    torch.set_num_threads(before)


if __name__ == "__main__":
    main()
