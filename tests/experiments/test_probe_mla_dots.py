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
