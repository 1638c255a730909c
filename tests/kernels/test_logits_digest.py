"""``logits_digest`` vs ``logits_digest_reference`` (and corun's LogitsDigest), bit for bit, on
rows holding every kind of fp32 bit pattern (negatives, NaNs, infinities, denormals) at odd V."""

import pytest
import torch

from corun.fingerprint import LogitsDigest
from kernels.logits_digest import LogitsDigestConfig, logits_digest, logits_digest_config
from kernels.reference import logits_digest_reference


def _random_bit_rows(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """fp32 rows from uniformly random int32 bit patterns, plus the special values spliced in."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (rows, vocab), generator=gen, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32).clone()
    specials = torch.tensor(
        [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-45, -3.4e38, 3.4e38]
    )
    x.view(-1)[: min(specials.numel(), x.numel())] = specials[: x.numel()]
    # A negative NaN pattern and the extreme int32 bit patterns, which sign-extend.
    x.view(torch.int32).view(-1)[-3:] = torch.tensor([-1, -(2**31), 2**31 - 1], dtype=torch.int32)
    return x


@pytest.mark.parametrize("vocab", [1, 37, 8191, 8192 + 19, 3 * 8192 + 1], ids=lambda v: f"V{v}")
def test_digest_equals_reference_bitwise(vocab):
    logits = _random_bit_rows(3, vocab, seed=vocab)
    out = logits_digest(logits)
    assert out.dtype == torch.int64 and out.shape == (3, 2)
    assert torch.equal(out, logits_digest_reference(logits))


def test_digest_equals_fingerprint_logits_digest():
    logits = _random_bit_rows(4, 1000, seed=7)
    assert torch.equal(logits_digest(logits), LogitsDigest(1000, "cpu")(logits))


def test_digest_strided_rows_and_any_split():
    """Rows may be strided views; another split of the row (BLOCK_V) gives the same bits, since
    the sums are integer adds mod 2**64."""
    wide = _random_bit_rows(3, 2 * 5000, seed=3)
    view = wide[:, 1000:6000]
    expected = logits_digest_reference(view)
    assert torch.equal(logits_digest(view), expected)
    small = LogitsDigestConfig(BLOCK_V=64, num_warps=1)  # 79 pieces a row instead of 1
    assert torch.equal(logits_digest(view, config=small), expected)


def test_digest_detects_one_bit():
    """Negative control: flipping the lowest bit of one logit changes that row's digest only."""
    logits = _random_bit_rows(3, 513, seed=11)
    flipped = logits.clone()
    flipped.view(torch.int32)[1, 200] ^= 1
    a, b = logits_digest(logits), logits_digest(flipped)
    assert torch.equal(a[[0, 2]], b[[0, 2]])
    assert not torch.equal(a[1], b[1])


def test_digest_bad_input_names_argument():
    with pytest.raises(ValueError, match="^logits"):
        logits_digest(torch.zeros(2, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="^logits"):
        logits_digest(torch.zeros(3))
    assert logits_digest(torch.zeros(0, 5)).shape == (0, 2)
    assert isinstance(logits_digest_config(10), LogitsDigestConfig)
