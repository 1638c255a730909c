"""A request's decode logits at tensor parallelism do not depend on its slot or co-runners.

tiny-qwen3 at TP=4 on gloo CPU ranks (4 q heads, 2 kv heads: one q head per rank, kv heads
replicated), torch backend fp32: each sequence is prefilled alone (corun's isolated prefill),
then one decode step runs at a fixed batch of 4 with the target in a drawn slot beside drawn
co-runners. Under corun (rank-order reduction past 2 ranks) the target's logits are the same
bits in every arrangement; under default at the very same shapes (the backend's ring
all_reduce) they are not, which is why corun does not use the plain all-reduce past 2 ranks.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kernels.mode import Mode
from models import build_model
from models.forward_batch import ForwardBatch, KVCache, OpsConfig
from models.parallel import ParallelContext, spawn_workers

WORLD, DECODE_BATCH, BLOCK_SIZE, BLOCKS_PER_SEQ = 4, 4, 8, 4
IN_STEP = settings(max_examples=6, derandomize=True, database=None, deadline=None,
                   phases=(Phase.explicit, Phase.generate),
                   suppress_health_check=list(HealthCheck))


def decode_logits(model: torch.nn.Module, prompts: list[torch.Tensor], ops: OpsConfig
                  ) -> torch.Tensor:
    """Prefill each prompt alone (sequence i in blocks of row i), then one decode step with
    sequence i in slot i; the decode logits [B, V]."""
    num_seqs = len(prompts)
    cache = KVCache(model.kv_cache_spec(), num_seqs * BLOCKS_PER_SEQ, BLOCK_SIZE, torch.float32,
                    "cpu")
    tables = torch.arange(num_seqs * BLOCKS_PER_SEQ, dtype=torch.int32).view(num_seqs, -1)

    def slots(seq: int, positions: torch.Tensor) -> torch.Tensor:
        return (tables[seq, positions // BLOCK_SIZE].long() * BLOCK_SIZE
                + positions % BLOCK_SIZE)

    next_ids = []
    for seq, prompt in enumerate(prompts):
        t, pos = prompt.shape[0], torch.arange(prompt.shape[0])
        batch = ForwardBatch(
            is_prefill=True, positions=pos, slot_mapping=slots(seq, pos),
            block_tables=tables[seq : seq + 1], kv_cache=cache, ops=ops,
            cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32),
            context_lens=torch.tensor([t], dtype=torch.int32), max_q_len=t,
            token_mask=torch.ones(t, dtype=torch.bool))
        hidden = model(prompt, batch)
        next_ids.append(int(model.compute_logits(hidden[-1:], ops).argmax()))
    lens = [p.shape[0] for p in prompts]
    pos = torch.tensor(lens)
    batch = ForwardBatch(
        is_prefill=False, positions=pos,
        slot_mapping=torch.cat([slots(s, pos[s : s + 1]) for s in range(num_seqs)]),
        block_tables=tables, kv_cache=cache, ops=ops,
        seq_lens=torch.tensor([n + 1 for n in lens], dtype=torch.int32),
        max_seq_len=BLOCKS_PER_SEQ * BLOCK_SIZE, token_mask=torch.ones(num_seqs, dtype=torch.bool))
    return model.compute_logits(model(torch.tensor(next_ids), batch), ops)


def _slot_invariance(parallel: ParallelContext) -> int:
    model, _ = build_model("tiny-qwen3", dtype=torch.float32, device="cpu", seed=11,
                           parallel=parallel)
    target = torch.randint(0, 256, (13,), generator=torch.Generator().manual_seed(1))
    variant_examples = []

    def arrangement(slot: int, seed: int, mode: Mode) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, 256, (int(torch.randint(1, 20, (1,), generator=gen)),),
                                 generator=gen) for _ in range(DECODE_BATCH)]
        prompts[slot] = target
        with torch.no_grad():
            return decode_logits(model, prompts, OpsConfig(mode=mode, backend="torch"))[slot]

    @IN_STEP
    @given(slot_a=st.integers(0, DECODE_BATCH - 1), slot_b=st.integers(0, DECODE_BATCH - 1),
           seed_a=st.integers(0, 2**63 - 1), seed_b=st.integers(0, 2**63 - 1))
    def target_is_slot_and_corunner_invariant(slot_a, slot_b, seed_a, seed_b):
        """Under corun at TP=4 the target's decode logits are the same bits whatever its slot
        and co-runners."""
        a, b = arrangement(slot_a, seed_a, Mode.CORUN), arrangement(slot_b, seed_b, Mode.CORUN)
        assert torch.equal(a, b)
        # Negative control, same shapes: the ring all_reduce of default.
        if not torch.equal(arrangement(slot_a, seed_a, Mode.DEFAULT),
                           arrangement(slot_b, seed_b, Mode.DEFAULT)):
            variant_examples.append((slot_a, slot_b))

    target_is_slot_and_corunner_invariant()
    return len(variant_examples)


def test_tp4_decode_is_slot_and_corunner_invariant_under_corun():
    """Under corun the target's logits hold across slots and co-runners; under default, at the
    same shapes, some arrangement changes them (the check can fail)."""
    variant = spawn_workers(_slot_invariance, WORLD, start_method="fork", num_threads=1,
                            timeout_s=150)
    assert variant[0] > 0
