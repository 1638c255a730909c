"""Shared tiny-engine settings for the CPU engine tests (torch backend, eager, fp32)."""

from __future__ import annotations

TINY = dict(model="tiny-qwen3", dtype="float32", device="cpu", max_num_seqs=4, max_model_len=64,
            block_size=4, prefill_chunk_size=8, max_num_batched_tokens=16,
            prefill_step_tokens=16, max_prefill_seqs_per_step=4, prefill_token_budget=16)
