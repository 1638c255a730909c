"""Mixed prefill + decode steps on the Triton backend (interpreted on the CPU), tiny models, fp32.

The dynamic schedules put decode tokens into prefill steps. With ``num_decode_tokens`` the
decode tokens go first and attention runs them through the decode path (``mla_decode`` for MLA),
so under batch_invariant a decode token's hidden row and logits are bitwise those of a pure decode
step, whatever prefill chunk shares its step. With path invariance (``OpsConfig.path_invariant``,
on by default) the decode token run as a prefill chunk of length 1 (``num_decode_tokens=0``)
has those bits too; the negative control turns path invariance off and shows that the prefill
path then gives it other bits, so the property can fail.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernels.mode import Mode
from models import build_model
from models.forward_batch import ForwardBatch, KVCache, OpsConfig
from tests.utils import assert_bitwise_equal

BLOCK_SIZE = 8  # the smallest the Triton attention kernels take
BLOCKS_PER_SEQ = 4
MAX_MODEL_LEN = BLOCK_SIZE * BLOCKS_PER_SEQ  # the batch_invariant decode grid bound
SPLIT = 16  # the decode split size: a decode sequence longer than 16 has two splits
OPS = OpsConfig(Mode.BATCH_INVARIANT, backend="triton", decode_split_size=SPLIT)
OPS_PATH_VARIANT = dataclasses.replace(OPS, path_invariant=False)
MODELS = ["tiny-qwen3", "tiny-deepseek-v3", "tiny-hy3"]
# tests/ does not load the invariance_tests profiles; the interpreter is slow: few examples.
FEW = settings(max_examples=1, deadline=None, derandomize=True)
I32 = torch.int32


@dataclass(frozen=True)
class Case:
    decode_len: int  # tokens of the decoding sequence A, its new token included
    chunk_start: int  # sequence B's chunk covers [chunk_start, chunk_end)
    chunk_end: int
    seed: int


@st.composite
def cases(draw) -> Case:
    start = draw(st.integers(0, 8))
    return Case(draw(st.integers(2, MAX_MODEL_LEN)), start, draw(st.integers(start + 1, 16)),
                draw(st.integers(0, 2**32 - 1)))


class Setup:
    """A model, a cache with A's context and B's cached prefix, and the tokens of both.

    A owns blocks [0, 4), B blocks [4, 8), each table reversed so that a wrong row of the block
    table can not pass by accident.
    """

    def __init__(self, name: str, case: Case) -> None:
        self.case = case
        self.model, config = build_model(name, dtype=torch.float32, device="cpu", seed=3)
        gen = torch.Generator().manual_seed(case.seed)
        self.tokens_a = torch.randint(0, config.vocab_size, (case.decode_len,), generator=gen)
        self.tokens_b = torch.randint(0, config.vocab_size, (case.chunk_end,), generator=gen)
        self.cache = KVCache(self.model.kv_cache_spec(), 2 * BLOCKS_PER_SEQ, BLOCK_SIZE,
                             torch.float32, "cpu")
        self.table_a = torch.arange(BLOCKS_PER_SEQ - 1, -1, -1, dtype=I32)
        self.table_b = self.table_a + BLOCKS_PER_SEQ
        # A's context (all but its new token) and B's prefix before the chunk, as earlier steps.
        self._forward(*self._prefill([(self.table_a, self.tokens_a, 0, case.decode_len - 1),
                                      (self.table_b, self.tokens_b, 0, case.chunk_start)]))
        self.snapshot = self.cache.storage.clone()

    @staticmethod
    def _slots(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return table[positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE

    def _prefill(self, chunks, num_decode_tokens: int = 0, decode=(), ops: OpsConfig = OPS):
        """(ids, batch) of decode tokens ``decode`` [(table, tokens)] then ``chunks``
        [(table, tokens, start, end)] (empty chunks skipped)."""
        chunks = [c for c in chunks if c[3] > c[2]]
        ids, pos, tables = [], [], []
        for table, tokens in decode:
            ids.append(tokens[-1:]), pos.append(torch.tensor([tokens.shape[0] - 1]))
            tables.append(table)
        for table, tokens, start, end in chunks:
            ids.append(tokens[start:end]), pos.append(torch.arange(start, end))
            tables.append(table)
        slots = torch.cat([self._slots(t, p) for t, p in zip(tables, pos, strict=True)])
        q_lens = [end - start for _, _, start, end in chunks]
        positions = torch.cat(pos)
        batch = ForwardBatch(
            is_prefill=True, positions=positions, slot_mapping=slots,
            block_tables=torch.stack(tables), kv_cache=self.cache, ops=ops,
            cu_seqlens_q=torch.tensor([0] + q_lens, dtype=I32).cumsum(0).to(I32),
            context_lens=torch.tensor([end for *_, end in chunks], dtype=I32),
            max_q_len=max(q_lens), max_seq_len=MAX_MODEL_LEN,
            seq_lens=torch.tensor([t.shape[0] for _, t in decode], dtype=I32) if decode else None,
            token_mask=torch.ones(positions.shape[0], dtype=torch.bool),
            num_decode_tokens=num_decode_tokens)
        return torch.cat(ids), batch

    def _forward(self, ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(ids, batch)

    def run(self, ids: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [T, H], logits [T, V]) from the cache as it was after the setup."""
        self.cache.storage.copy_(self.snapshot)
        hidden = self._forward(ids, batch)
        with torch.inference_mode():
            return hidden, self.model.compute_logits(hidden, OPS)

    def pure_decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A's token in a decode step of 2 slots (the engine's bucket), slot 1 a dummy."""
        n = self.case.decode_len
        batch = ForwardBatch(
            is_prefill=False, positions=torch.tensor([n - 1, 0]),
            slot_mapping=torch.tensor([int(self._slots(self.table_a, torch.tensor(n - 1))), -1]),
            block_tables=torch.stack([self.table_a, torch.zeros_like(self.table_a)]),
            kv_cache=self.cache, ops=OPS, seq_lens=torch.tensor([n, 0], dtype=I32),
            max_seq_len=MAX_MODEL_LEN, token_mask=torch.tensor([True, False]))
        return self.run(torch.tensor([int(self.tokens_a[-1]), 0]), batch)

    def mixed(self, split: bool, ops: OpsConfig = OPS) -> tuple[torch.Tensor, torch.Tensor]:
        """A's token beside B's chunk: split (decode part first) or, unsplit, A's token as a
        prefill chunk of length 1 followed by B's chunk."""
        c = self.case
        chunk_b = (self.table_b, self.tokens_b, c.chunk_start, c.chunk_end)
        if split:
            return self.run(*self._prefill([chunk_b], 1, [(self.table_a, self.tokens_a)],
                                           ops=ops))
        chunk_a = (self.table_a, self.tokens_a, c.decode_len - 1, c.decode_len)
        return self.run(*self._prefill([chunk_a, chunk_b], ops=ops))


_SETUPS: dict[tuple[str, Case], Setup] = {}


def _setup(name: str, case: Case) -> Setup:
    if (name, case) not in _SETUPS:
        _SETUPS[(name, case)] = Setup(name, case)
    return _SETUPS[(name, case)]


PINNED = Case(decode_len=21, chunk_start=3, chunk_end=9, seed=7)  # two decode splits


@pytest.mark.parametrize("name", MODELS)
@FEW
@given(case=cases())
@example(case=PINNED)
def test_decode_token_in_mixed_step_has_pure_decode_bits(name, case):
    """Under batch_invariant a decode token's hidden row and logits in a mixed step equal its
    bits in a pure decode step."""
    setup = _setup(name, case)
    hidden, logits = setup.pure_decode()
    mixed_hidden, mixed_logits = setup.mixed(split=True)
    assert_bitwise_equal(mixed_hidden[0], hidden[0], f"{name} {case} hidden")
    assert_bitwise_equal(mixed_logits[0], logits[0], f"{name} {case} logits")


@pytest.mark.parametrize("name", MODELS)
def test_decode_token_as_prefill_chunk_has_decode_bits(name):
    """Path invariance: the same step with num_decode_tokens=0 (A's token through the prefill
    path, beside B's chunk) gives the token its pure decode step's hidden row and logits."""
    setup = _setup(name, PINNED)
    hidden, logits = setup.pure_decode()
    unsplit_hidden, unsplit = setup.mixed(split=False)
    assert_bitwise_equal(unsplit_hidden[0], hidden[0], f"{name} hidden")
    assert_bitwise_equal(unsplit[0], logits[0], f"{name} logits")


@pytest.mark.parametrize("name", MODELS)
def test_decode_token_as_prefill_chunk_differs_negative_control(name):
    """The check can fail: without path invariance the prefill path (attention over the whole
    context as one split; MLA's expanded form) gives the token other bits."""
    setup = _setup(name, PINNED)
    _, logits = setup.pure_decode()
    _, unsplit = setup.mixed(split=False, ops=OPS_PATH_VARIANT)
    assert not torch.equal(unsplit[0], logits[0]), f"{name}: prefill path matched decode bits"


@pytest.mark.parametrize("name", MODELS)
def test_prefill_chunk_rows_unchanged_by_mixed_decode_token(name):
    """Under batch_invariant B's chunk rows in the mixed step equal those of B's chunk alone."""
    setup = _setup(name, PINNED)
    c = PINNED
    alone, _ = setup.run(*setup._prefill([(setup.table_b, setup.tokens_b, c.chunk_start,
                                           c.chunk_end)]))
    mixed, _ = setup.mixed(split=True)
    assert_bitwise_equal(mixed[1:], alone, f"{name} chunk rows")


def test_mixed_batch_fields_are_validated():
    """A mixed batch whose seq_lens or block-table rows do not match num_decode_tokens raises."""
    setup = _setup("tiny-qwen3", PINNED)
    chunk_b = (setup.table_b, setup.tokens_b, 0, 4)
    _, batch = setup._prefill([chunk_b], 1, [(setup.table_a, setup.tokens_a)])
    fields = dict(is_prefill=True, positions=batch.positions, slot_mapping=batch.slot_mapping,
                  kv_cache=setup.cache, ops=OPS, cu_seqlens_q=batch.cu_seqlens_q,
                  context_lens=batch.context_lens, max_q_len=4, max_seq_len=MAX_MODEL_LEN)
    with pytest.raises(ValueError, match="seq_lens"):
        ForwardBatch(block_tables=batch.block_tables, seq_lens=None, num_decode_tokens=1,
                     **fields)
    with pytest.raises(ValueError, match="block_tables"):
        ForwardBatch(block_tables=batch.block_tables[1:], seq_lens=batch.seq_lens,
                     num_decode_tokens=1, **fields)
    with pytest.raises(ValueError, match="num_decode_tokens"):
        ForwardBatch(block_tables=batch.block_tables, seq_lens=batch.seq_lens,
                     num_decode_tokens=6, **fields)
    with pytest.raises(ValueError, match="num_decode_tokens"):
        ForwardBatch(**dict(fields, is_prefill=False), block_tables=batch.block_tables,
                     seq_lens=batch.seq_lens, num_decode_tokens=1)
