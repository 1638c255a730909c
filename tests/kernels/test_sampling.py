"""Sampling kernels vs the references: Philox noise bit for bit, token ids equal to
``sample_reference`` on tie-free logits through both paths of the top-k/top-p search (candidate
lists, whole-row fallback), greedy ties, edge rows, the empirical distribution of many seeded
draws (chi-square), and ``token_logprobs`` vs an fp64 log-softmax."""

import dataclasses

import pytest
import torch

from kernels.sampling import (
    SamplingConfig,
    _sample_launch,
    pieces_per_program,
    sample,
    sampling_config,
    sampling_uniform,
    token_logprobs,
)
from kernels.sampling_reference import (
    SAMPLING_U_MAX,
    philox_4x32,
    sample_reference,
    sampling_uniform_reference,
    top_k_top_p_mask_reference,
)
from tests.utils import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Chi-square critical values at alpha = 1e-3 by degrees of freedom: a correct sampler fails a
# fresh draw with probability 0.1%; the draws here are fixed by their seeds.
CHI2_CRITICAL_1E3 = {1: 10.83, 2: 13.82, 3: 16.27}


def _rows(batch, seed):
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-(2**63), 2**63 - 1, (batch,), generator=gen, dtype=torch.int64)
    sample_indices = torch.randint(0, 4, (batch,), generator=gen)
    positions = torch.randint(0, 1 << 20, (batch,), generator=gen)
    return gen, seeds, sample_indices, positions


def _distinct_logits(batch, vocab, gen, dtype):
    # Distinct values 0.05 apart, exact in fp16/bf16 for |x| < 4: no ties for top-k to break.
    rows = [
        (torch.randperm(vocab, generator=gen) - vocab // 2) * (6.0 / vocab) for _ in range(batch)
    ]
    return torch.stack(rows).to(dtype)


def test_uniform_equals_reference_bitwise():
    seeds = torch.tensor([0, -1, 2**63 - 1, -(2**63), (1 << 40) + 3, 12345], dtype=torch.int64)
    sample_indices = torch.tensor([0, 1, 7, 0, 3, 2**20])
    positions = torch.tensor([0, 5, 2**31 - 1, 17, 1, 100000], dtype=torch.int32)
    for vocab in (37, 4113):
        u = sampling_uniform(seeds, sample_indices, positions, vocab)
        assert torch.equal(u, sampling_uniform_reference(seeds, sample_indices, positions, vocab))


# A draw whose Philox word has all top 24 bits set: (2**24 - 1 + 0.5) / 2**24 rounds to 1.0 in fp32.
TOP_WORD_SEED, TOP_WORD_POSITION, TOP_WORD_TOKEN, QWEN3_VOCAB = 1234, 32, 128157, 151936


def test_noise_stays_below_one_where_the_word_is_all_ones():
    seed = torch.tensor([TOP_WORD_SEED])
    counter = tuple(torch.tensor([[v]]) for v in (TOP_WORD_TOKEN, TOP_WORD_POSITION, 0, 0))
    word = philox_4x32(counter, (seed.view(-1, 1), torch.zeros(1, 1, dtype=torch.int64)))[0]
    assert int(word) >> 8 == (1 << 24) - 1  # the edge case this test is about
    args = (seed, torch.tensor([0]), torch.tensor([TOP_WORD_POSITION]), QWEN3_VOCAB)
    u = sampling_uniform_reference(*args)
    assert float(u[0, TOP_WORD_TOKEN]) == SAMPLING_U_MAX < 1.0
    assert torch.equal(sampling_uniform(*args), u)
    # A row sure of token 7 (every other token ~e^-60 below it) must not draw the edge token.
    logits = torch.full((1, QWEN3_VOCAB), -30.0)
    logits[0, 7] = 30.0
    draw = (logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([1.0]), seed,
            torch.tensor([0]), torch.tensor([TOP_WORD_POSITION]))
    assert int(sample_reference(*draw)) == 7
    assert int(sample(*draw)) == 7


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_sample_equals_reference(dtype):
    _, seeds, sample_indices, positions = _rows(6, seed=1)
    gen = torch.Generator().manual_seed(2)
    logits = _distinct_logits(6, 123, gen, dtype)
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.5, 0.0, 2.0])
    top_k = torch.tensor([0, 5, 0, 10, 3, 200])
    top_p = torch.tensor([1.0, 1.0, 0.8, 0.9, 0.5, 0.2])
    args = (logits, temperature, top_k, top_p, seeds, sample_indices, positions)
    assert torch.equal(sample(*args), sample_reference(*args))


def test_sample_equals_reference_multi_block_vocab():
    _, seeds, sample_indices, positions = _rows(3, seed=3)
    logits = _distinct_logits(3, 4096 + 17, torch.Generator().manual_seed(4), torch.float32)
    args = (
        logits,
        torch.tensor([1.0, 0.6, 0.0]),
        torch.tensor([0, 40, 0]),
        torch.tensor([1.0, 0.9, 1.0]),
        seeds,
        sample_indices,
        positions,
    )
    assert torch.equal(sample(*args), sample_reference(*args))


# Pieces of 16 columns with lists of 4: rows keeping more than ~4 tokens of a piece take the
# whole-row fallback, the others the candidate lists; from 4 rows on a program reads 2 pieces.
SMALL = SamplingConfig(CHUNK=16, R=4, BLOCK_V=256, sweep_warps=1, num_warps=1, combine_warps=1,
                       pieces_per_program=2, group_from_batch=4)


def _random_rows(batch, vocab, seed):
    """Tie-free rows at three logit scales (flat to peaked) with mixed sampling parameters."""
    _, seeds, sample_indices, positions = _rows(batch, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    scale = torch.tensor([3.0, 20.0, 120.0])[torch.arange(batch) % 3].view(-1, 1)
    logits = _distinct_logits(batch, vocab, gen, torch.float32) * scale / 6.0
    temperature = torch.rand(batch, generator=gen) + 0.4
    top_k = torch.randint(1, vocab + 5, (batch,), generator=gen)
    top_k = torch.where(torch.rand(batch, generator=gen) < 0.4, 0, top_k)
    top_p = torch.rand(batch, generator=gen)
    top_p = torch.where(torch.rand(batch, generator=gen) < 0.6, top_p, 1.0)
    return (logits, temperature, top_k, top_p, seeds, sample_indices, positions)


@pytest.mark.parametrize("config", [None, SMALL], ids=["policy", "small-pieces"])
@pytest.mark.parametrize("vocab", [67, 150], ids=lambda v: f"V{v}")
def test_sample_equals_reference_both_paths(vocab, config):
    """Random top-k/top-p rows: the same token as the reference whichever path decides; with
    small pieces both paths run in the same batch."""
    args = _random_rows(9, vocab, seed=vocab)
    cfg = config or sampling_config(vocab, torch.float32)
    out, path = _sample_launch(*args, cfg)
    assert torch.equal(out, sample_reference(*args))
    truncated = ((args[2] > 0) & (args[2] < vocab)) | (args[3] < 1.0)
    if config is SMALL:
        assert {0, 1} <= set(path[truncated].tolist()), "both paths must run"
    assert torch.equal(sample(*args, config=config), out)


def test_fallback_and_lists_give_the_same_thresholds():
    """The same rows through the policy (lists hold every kept set) and through 8-column pieces
    with lists of 2 (most rows fall back): the same tokens."""
    args = _random_rows(6, 120, seed=5)
    tiny = SamplingConfig(CHUNK=8, R=2, BLOCK_V=128, sweep_warps=1, num_warps=1, combine_warps=1)
    out_policy, _ = _sample_launch(*args, sampling_config(120, torch.float32))
    out_tiny, path = _sample_launch(*args, tiny)
    assert int(path[(args[2] > 0) | (args[3] < 1)].sum()) >= 3
    assert torch.equal(out_policy, out_tiny)


def test_fallback_top_p_keeps_the_whole_top_k_set():
    """Rows whose three best tokens share a piece (lists of 2: the fallback decides), top_k = 3
    and a top_p the three reach only together: every one of the three is drawn by some seed, as
    in the reference (a search that started above the k-th key would never draw the third)."""
    n, vocab = 12, 16
    row = torch.full((vocab,), -6.0) - torch.arange(vocab) * 0.01
    row[:3] = torch.tensor([1.0, 0.99, 0.98])
    args = (
        row.repeat(n, 1),
        torch.ones(n),
        torch.full((n,), 3),
        torch.full((n,), 0.9999),
        torch.arange(n, dtype=torch.int64) * 7919 + 1,
        torch.zeros(n, dtype=torch.int64),
        torch.full((n,), 4),
    )
    out, path = _sample_launch(*args, SamplingConfig(CHUNK=8, R=2, BLOCK_V=16, sweep_warps=1,
                                                     num_warps=1, combine_warps=1))
    assert path.tolist() == [1] * n
    assert set(out.tolist()) == {0, 1, 2}
    assert torch.equal(out, sample_reference(*args))


@pytest.mark.parametrize("config", [None, SMALL], ids=["policy", "small-pieces"])
def test_edge_rows(config):
    """All -inf rows give id 0 (as torch's argmax); -inf entries are never drawn; top_p = 0 and
    top_k = 1 keep the argmax of logits / T; a vocab that is not a multiple of the piece."""
    vocab = 37
    gen = torch.Generator().manual_seed(9)
    logits = _distinct_logits(6, vocab, gen, torch.float32)
    logits[0] = float("-inf")
    logits[1] = float("-inf")
    logits[2, ::2] = float("-inf")
    temperature = torch.tensor([0.0, 1.0, 1.0, 0.9, 0.9, 1.1])
    top_k = torch.tensor([0, 3, 0, 1, 0, 0])
    top_p = torch.tensor([1.0, 0.5, 1.0, 1.0, 0.0, 0.3])
    _, seeds, sample_indices, positions = _rows(6, seed=9)
    args = (logits, temperature, top_k, top_p, seeds, sample_indices, positions)
    out = sample(*args, config=config)
    assert out[:2].tolist() == [0, 0]
    assert int(out[2]) % 2 == 1
    assert out[3] == logits[3].argmax() and out[4] == logits[4].argmax()
    assert torch.equal(out[2:], sample_reference(*args)[2:])


def test_sampling_config_pieces():
    cfg = sampling_config(151936, torch.float32)
    assert (cfg.CHUNK, cfg.R, cfg.combine_warps) == (1024, 32, 16)
    assert [pieces_per_program(cfg, b) for b in (1, 63, 64, 256)] == [1, 1, 2, 2]
    assert sampling_config(129280, torch.bfloat16).combine_warps == 8
    small = sampling_config(67, torch.float32)
    assert small.CHUNK == 128 and pieces_per_program(small, 256) == 1
    with pytest.raises(ValueError, match="pieces_per_program"):
        dataclasses.replace(cfg, pieces_per_program=3)


@pytest.mark.parametrize("vocab", [150, 160], ids=lambda v: f"V{v}")
def test_pieces_per_program_change_no_draw(vocab):
    """Greedy, temperature-only and top-k/top-p rows, with 10 pieces a row: a program reading 1,
    2, 4 or 16 pieces (a tail group half empty, or one group past the row) draws the same tokens
    by the same path."""
    args = _random_rows(8, vocab, seed=3)
    args[1][::3] = 0.0  # greedy rows
    args[2][1::3], args[3][1::3] = 0, 1.0  # temperature-only rows
    one = dataclasses.replace(SMALL, pieces_per_program=1)
    out, path = _sample_launch(*args, one)
    assert torch.equal(out, sample_reference(*args))
    truncated = (((args[2] > 0) & (args[2] < vocab)) | (args[3] < 1.0)) & (args[1] > 0)
    assert truncated.any()
    for pieces in (2, 4, 16):
        cfg = dataclasses.replace(SMALL, pieces_per_program=pieces, group_from_batch=1)
        grouped, grouped_path = _sample_launch(*args, cfg)
        assert torch.equal(grouped, out), pieces
        assert torch.equal(grouped_path[truncated], path[truncated]), pieces


def test_temperature_zero_is_argmax_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 1.0, 3.0, -1.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0, 5.0, 5.0]])
    one = torch.ones(2, dtype=torch.int64)
    out = sample(
        logits, torch.zeros(2), torch.tensor([2, 0]), torch.tensor([0.5, 0.1]), one, one, one
    )
    assert out.tolist() == [2, 0]


LOGITS_4_VALUES = [2.0, 0.5, 1.5, 1.0]
TEMPERATURE = 0.8
NUM_DRAWS = 96
CONFIGS = {"plain": (0, 1.0), "top-k-3": (3, 1.0), "top-p-0.7": (0, 0.7)}


@pytest.fixture(scope="module")
def draws():
    """NUM_DRAWS seeded draws per config, one batched call (the interpreter runs rows serially)."""
    seeds = torch.arange(NUM_DRAWS, dtype=torch.int64) * 1_000_003 + 11
    out = {}
    for name, (k, p) in CONFIGS.items():
        n = NUM_DRAWS
        out[name] = sample(
            torch.tensor(LOGITS_4_VALUES).repeat(n, 1),
            torch.full((n,), TEMPERATURE),
            torch.full((n,), k),
            torch.full((n,), p),
            seeds,
            torch.zeros(n, dtype=torch.int64),
            torch.full((n,), 9),
        )
    return out


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    support = probs > 0
    assert int(counts[~support].sum()) == 0, "drew a token outside the top-k/top-p set"
    expected = probs[support] * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


@pytest.mark.parametrize("name", list(CONFIGS))
def test_empirical_distribution_matches_softmax(draws, name):
    k, p = CONFIGS[name]
    scaled = (torch.tensor(LOGITS_4_VALUES) / TEMPERATURE).view(1, -1)
    keep = top_k_top_p_mask_reference(scaled, torch.tensor([k]), torch.tensor([p]))[0]
    probs = torch.where(keep, torch.softmax(scaled[0].double(), 0), 0.0)
    probs = probs / probs.sum()
    counts = torch.bincount(draws[name], minlength=4).double()
    stat, dof = _chi_square(counts, probs)
    assert stat < CHI2_CRITICAL_1E3[dof], f"chi2 {stat:.2f} (dof {dof}), counts {counts.tolist()}"
    # Negative control: the same counts reject the probabilities reversed over the same set.
    wrong = probs.clone()
    wrong[keep] = probs[keep].flip(0)
    wrong_stat, _ = _chi_square(counts, wrong)
    assert wrong_stat > CHI2_CRITICAL_1E3[dof]


def test_different_seeds_give_different_draws(draws):
    assert len(set(draws["plain"].tolist())) == 4  # all four tokens appear across seeds
    # Control: one seed for every row gives one token, so the check above can fail.
    n = 8
    same = sample(
        torch.tensor(LOGITS_4_VALUES).repeat(n, 1),
        torch.full((n,), TEMPERATURE),
        torch.zeros(n, dtype=torch.int64),
        torch.ones(n),
        torch.full((n,), 11),
        torch.zeros(n, dtype=torch.int64),
        torch.full((n,), 9),
    )
    assert len(set(same.tolist())) == 1


def test_sample_indices_give_distinct_noise_and_draws():
    n = 16
    seeds, positions = torch.full((n,), 42), torch.full((n,), 3)
    sample_indices = torch.arange(n)
    u = sampling_uniform(seeds, sample_indices, positions, 64)
    assert len({tuple(row) for row in u.tolist()}) == n
    tokens = sample(
        torch.tensor(LOGITS_4_VALUES).repeat(n, 1),
        torch.ones(n),
        torch.zeros(n, dtype=torch.int64),
        torch.ones(n),
        seeds,
        sample_indices,
        positions,
    )
    assert len(set(tokens.tolist())) >= 2


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("vocab", [123, 4096 + 17])
def test_token_logprobs_matches_log_softmax(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    logits = (3 * torch.randn(3, vocab, generator=gen)).to(dtype)
    token_ids = torch.randint(0, vocab, (3,), generator=gen)
    expected = torch.log_softmax(logits.double(), dim=-1).gather(1, token_ids.view(-1, 1))[:, 0]
    out = token_logprobs(logits, token_ids)
    assert out.dtype == torch.float32
    assert_close(out, expected, torch.float32, reduce_dim=vocab)


def test_token_logprobs_reads_a_strided_token_column():
    """The runner passes column 0 of its [R, 3] samples (token id, digest, digest): row b must
    read its own id, not the next column (it did: NaN logprobs from row 1 on)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 50, generator=gen)
    samples = torch.tensor([[4, 10**9, -7], [17, 10**9, -7], [33, 10**9, -7]])
    expected = torch.log_softmax(logits.double(), dim=-1).gather(1, samples[:, :1])[:, 0]
    assert_close(token_logprobs(logits, samples[:, 0]), expected, torch.float32, reduce_dim=50)


def test_token_logprobs_out_of_range_id_is_nan():
    out = token_logprobs(torch.randn(2, 10), torch.tensor([10, -1]))
    assert torch.isnan(out).all()


@pytest.mark.parametrize(
    "field, value",
    [
        ("logits", torch.randn(2, 10, dtype=torch.float64)),
        ("temperature", torch.ones(2, dtype=torch.float64)),
        ("top_k", torch.zeros(3, dtype=torch.int64)),
        ("top_p", torch.ones(2, 1)),
        ("seeds", torch.zeros(2, dtype=torch.int32)),
        ("sample_indices", torch.zeros(2)),
        ("positions", torch.zeros(2, 2, dtype=torch.int64)),
    ],
)
def test_sample_bad_input_names_argument(field, value):
    args = {
        "logits": torch.randn(2, 10),
        "temperature": torch.ones(2),
        "top_k": torch.zeros(2, dtype=torch.int64),
        "top_p": torch.ones(2),
        "seeds": torch.zeros(2, dtype=torch.int64),
        "sample_indices": torch.zeros(2, dtype=torch.int64),
        "positions": torch.zeros(2, dtype=torch.int64),
    }
    args[field] = value
    with pytest.raises(ValueError, match=f"^{field}"):
        sample(**args)


def test_token_logprobs_bad_input_names_argument():
    with pytest.raises(ValueError, match="^token_ids"):
        token_logprobs(torch.randn(2, 10), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="^logits"):
        token_logprobs(torch.randn(10), torch.zeros(1, dtype=torch.int64))


def test_token_logprobs_of_many_ids_per_row_match_one_id_per_row():
    """[B, K] ids share each row's logsumexp: every column equals the [B] call on that column."""
    logits = torch.randn(3, 300)
    ids = torch.tensor([[0, 299, 5], [7, 7, 1], [150, 2, 3]])
    many = token_logprobs(logits, ids)
    for k in range(ids.shape[1]):
        assert torch.equal(many[:, k], token_logprobs(logits, ids[:, k].contiguous()))
    assert many.shape == (3, 3)
