"""probe_mla_dots's kernel on the interpreter: the loop it times computes (q . kv^T) . V, the
step-late P.V included (a wrong carry would drop or repeat a tile), with the online softmax put
back and over a paged cache it gives what the contiguous reference gives, and bad shapes are
refused."""

from __future__ import annotations

import pytest
import torch

from experiments.probe_mla_dots import mla_dots, mla_dots_reference

LATENT, ROPE, HEADS = 32, 16, 32
TILES = {"block_h": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}


def _inputs(ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(ctx)
    return torch.randn(2, HEADS, LATENT + ROPE), torch.randn(2, ctx, LATENT + ROPE)


@pytest.mark.parametrize("softmax", [False, True])
@pytest.mark.parametrize("ctx", [16, 48])
def test_the_probe_loop_computes_the_two_products(ctx, softmax):
    q, kv = _inputs(ctx)
    out = mla_dots(q, kv, LATENT, softmax=softmax, **TILES)
    torch.testing.assert_close(out, mla_dots_reference(q, kv, LATENT, softmax), rtol=1e-4,
                               atol=1e-3)


def test_the_paged_loop_reads_each_sequence_through_its_block_table():
    q, kv = _inputs(64)
    page = 16
    pages = kv.reshape(2 * 64 // page, page, LATENT + ROPE)  # sequence b owns pages 4b .. 4b + 3
    order = torch.randperm(pages.shape[0])  # scatter them: the table must undo it
    cache = torch.empty_like(pages)
    cache[order] = pages
    tables = order.view(2, 4).to(torch.int32)
    out = mla_dots(q, cache, LATENT, softmax=True, block_tables=tables, ctx=64, **TILES)
    torch.testing.assert_close(out, mla_dots_reference(q, kv, LATENT, True), rtol=1e-4,
                               atol=1e-3)


def test_the_probe_refuses_shapes_its_tiles_do_not_divide():
    q, kv = torch.randn(1, 24, 48), torch.randn(1, 32, 48)
    with pytest.raises(ValueError, match="heads % 16"):
        mla_dots(q, kv, 32, block_h=16, block_n=16)


def test_the_lazy_rescale_gives_the_same_bits():
    """Skipping the accumulator's rescale in steps where no row's max moved multiplies by exactly
    1.0 elsewhere: the same bits as rescaling every step. The first sequence's later tiles score
    near zero (its max stays put after the first tile: the skip is taken), the second's higher
    (its max moves: the rescale runs)."""
    q, kv = _inputs(64)
    kv[0, 16:] *= 0.01
    kv[1, 32:] *= 3.0
    eager = mla_dots(q, kv, LATENT, softmax=True, **TILES)
    lazy = mla_dots(q, kv, LATENT, softmax=True, lazy_rescale=True, **TILES)
    assert torch.equal(lazy, eager)


def test_collect_times_every_variant_and_the_kernel_at_each_point(monkeypatch):
    """The device run's loop on the CPU (interpreter, small dims, timing stubbed to the call
    count so each column names the variant it timed): every variant runs at every point and
    each share of the peak is the MMA floor over its own time."""
    from experiments import bench_mla, harness
    from experiments import probe_mla_dots as probe

    monkeypatch.setattr(bench_mla, "DEVICE", "cpu")
    monkeypatch.setattr(bench_mla, "DTYPE", torch.float32)  # the interpreter's bf16 dot is wrong
    monkeypatch.setattr(bench_mla, "v3_dims",
                        lambda: {"heads": 64, "latent": 32, "rope": 16, "scale": 0.2})
    monkeypatch.setattr(probe, "POINTS", ((1, 64),))
    calls = []

    def timed(fn, **kwargs):
        fn()
        calls.append(len(calls) + 1)
        return float(calls[-1])  # 1, 2, 3, ... us in the order the columns are timed

    monkeypatch.setattr(harness, "bench_us", timed)
    monkeypatch.setattr(harness, "matmul_rate", lambda: 1e12)
    [record] = probe.collect()
    assert [record[k] for k in ("dots_us", "softmax_us", "softmax_lazy_rescale_us",
                                "paged_softmax_us", "mla_decode_default_us")] == [1, 2, 3, 4, 5]
    floor = record["mma_floor_us"]  # rounded to 3 places; the shares use the exact floor
    assert record["paged_softmax_of_peak"] == pytest.approx(floor / 4, abs=1e-3)
    assert record["kernel_of_peak"] == pytest.approx(floor / 5, abs=1e-3)
