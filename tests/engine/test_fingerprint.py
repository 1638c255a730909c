"""The logits digest is exact, per row, order-independent, and sensitive to a single bit."""

import torch

from corun.fingerprint import Fingerprint, LogitsDigest


def test_digest_of_a_row_does_not_depend_on_its_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 97, generator=gen)
    digest = LogitsDigest(97, "cpu")
    batch = digest(logits)
    for row in range(5):
        assert torch.equal(digest(logits[row : row + 1])[0], batch[row])
    assert torch.equal(digest(logits.flip(0)), batch.flip(0))


def test_digest_sees_one_flipped_bit_and_a_swap():
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    digest = LogitsDigest(64, "cpu")
    flipped = logits.clone().view(torch.int32)
    flipped[0, 17] ^= 1
    assert not torch.equal(digest(flipped.view(torch.float32)), digest(logits))
    swapped = logits.clone()
    swapped[0, [3, 4]] = swapped[0, [4, 3]]
    assert not torch.equal(digest(swapped), digest(logits))


def test_fingerprint_hashes_tokens_and_digests_in_order():
    a, b = Fingerprint(), Fingerprint()
    a.update(5, (1, 2))
    b.update(5, (1, 2))
    assert a.hexdigest() == b.hexdigest()
    a.update(6, (3, 4))
    b.update(6, (3, 5))
    assert a.hexdigest() != b.hexdigest() and a.num_tokens == 2
