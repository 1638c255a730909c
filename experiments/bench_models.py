"""Whole-model prefill and decode on the H200: real shapes, random bf16 weights, Triton kernels in
corun mode.

For each model (depth-truncated where the full one does not fit one GPU; see models/config.py),
built alone and freed before the next:

- prefill: one isolated 2048-token sequence (corun's prefill), logits of its last token;
- decode: one step at the fixed batch of 64 slots, each with a 2048-token context (the cache is
  filled with random values: decode attention reads the same bytes whatever they hold), logits
  of all 64 rows;
- logits checked finite; time (prefill eager, decode from a CUDA graph; medians), tokens/s,
  peak memory, and the decode
  step's memory bound: (weight bytes read + KV bytes read) / the card's copy bandwidth (4.3
  TB/s on the H200). Weight bytes count every matrix read by the step; for MoE layers the experts
  expected to receive at least one of the 64 x top_k choices under uniform routing (random weights
  route near-uniformly), and not the
  embedding table (a 64-row gather) unless it is tied to the LM head.

Writes experiments/results/models-h200.json. Usage: python -m experiments.bench_models
[--models qwen3-8b deepseek-v3-l6 hy3-l14] [--prefill-len 2048] [--decode-batch 64].
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from experiments.harness import bench_us, card_tag, memory_bound_us, write_results
from kernels.mode import Mode
from models import build_model
from models.config import NAMED_CONFIGS, ModelConfig, num_parameters
from models.forward_batch import ForwardBatch, KVCache, OpsConfig

DEFAULT_MODELS = ["qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b", "qwen3-235b-a22b-l12",
                  "deepseek-v3-l6", "hy3-l14"]
BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096  # the corun decode grid bound (max_seq_len) and each slot's block-table width


def decode_weight_bytes(config: ModelConfig, batch_size: int, elem_bytes: int) -> float:
    """Bytes of weights one decode step of ``batch_size`` tokens reads (see module doc)."""
    total = num_parameters(config)
    if not config.tie_word_embeddings:
        total -= config.vocab_size * config.hidden_size  # the embedding is only gathered
    if config.num_experts:
        e, k = config.num_experts, config.num_experts_per_tok
        touched = e * (1 - (1 - k / e) ** batch_size)
        per_expert = 3 * config.moe_intermediate_size * config.hidden_size
        moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
        total -= moe_layers * (e - touched) * per_expert
    return total * elem_bytes


def kv_bytes_per_token(model: torch.nn.Module, elem_bytes: int) -> int:
    spec = model.kv_cache_spec()
    per_layer = 2 * spec.num_kv_heads * spec.head_dim if spec.kind == "mha" else spec.entry_dim
    return spec.num_layers * per_layer * elem_bytes


def bench_model(name: str, prefill_len: int, decode_batch: int, device: torch.device,
                decode_fused_combine: bool = False) -> dict:
    dtype = torch.bfloat16
    ops = OpsConfig(mode=Mode.CORUN, backend="triton", decode_fused_combine=decode_fused_combine)
    torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    model, config = build_model(name, dtype=dtype, device=device, seed=0)
    build_s = time.perf_counter() - start
    blocks_per_seq = MAX_MODEL_LEN // BLOCK_SIZE
    context = prefill_len  # each decode slot's context before the new token
    cache = KVCache(model.kv_cache_spec(), decode_batch * blocks_per_seq, BLOCK_SIZE, dtype,
                    device)
    cache.storage.normal_(0.0, 0.5, generator=torch.Generator(device).manual_seed(1))
    block_tables = torch.arange(decode_batch * blocks_per_seq, dtype=torch.int32,
                                device=device).view(decode_batch, blocks_per_seq)
    gen = torch.Generator(device).manual_seed(2)

    # Prefill: slot 0's sequence alone.
    prompt = torch.randint(0, config.vocab_size, (prefill_len,), device=device, generator=gen)
    positions = torch.arange(prefill_len, device=device)
    prefill = ForwardBatch(
        is_prefill=True, positions=positions,
        slot_mapping=block_tables[0, positions // BLOCK_SIZE].long() * BLOCK_SIZE
        + positions % BLOCK_SIZE,
        block_tables=block_tables[:1], kv_cache=cache, ops=ops,
        cu_seqlens_q=torch.tensor([0, prefill_len], dtype=torch.int32, device=device),
        context_lens=torch.tensor([prefill_len], dtype=torch.int32, device=device),
        max_q_len=prefill_len, token_mask=torch.ones(prefill_len, dtype=torch.bool, device=device))

    def run_prefill() -> torch.Tensor:
        return model.compute_logits(model(prompt, prefill)[-1:], ops)

    # Decode: every slot appends its token at position `context`.
    pos = torch.full((decode_batch,), context, device=device)
    decode = ForwardBatch(
        is_prefill=False, positions=pos,
        slot_mapping=block_tables[:, context // BLOCK_SIZE].long() * BLOCK_SIZE
        + context % BLOCK_SIZE,
        block_tables=block_tables, kv_cache=cache, ops=ops,
        seq_lens=torch.full((decode_batch,), context + 1, dtype=torch.int32, device=device),
        max_seq_len=MAX_MODEL_LEN,
        token_mask=torch.ones(decode_batch, dtype=torch.bool, device=device),
        # Held across replays, as the engine's step buffers hold it (ForwardBatch.decode_arrivals).
        decode_arrivals=torch.zeros(decode_batch * max(1, cache.spec.num_kv_heads),
                                    dtype=torch.int32, device=device))
    step_ids = torch.randint(0, config.vocab_size, (decode_batch,), device=device, generator=gen)

    def run_decode() -> torch.Tensor:
        return model.compute_logits(model(step_ids, decode), ops)

    with torch.no_grad():
        prefill_logits, decode_logits = run_prefill(), run_decode()
        finite = bool(torch.isfinite(prefill_logits).all() and torch.isfinite(decode_logits).all())
        # As the engine runs them: prefill eager, decode replayed from a CUDA graph.
        prefill_us = bench_us(run_prefill, cuda_graph=False)
        decode_us = bench_us(run_decode, cuda_graph=True)
    torch.cuda.synchronize(device)
    weight_bytes = decode_weight_bytes(config, decode_batch, 2)
    kv_read = decode_batch * (context + 1) * kv_bytes_per_token(model, 2)
    bound_us = memory_bound_us(weight_bytes + kv_read)
    record = {
        "model": name, "architecture": config.architecture,
        "num_hidden_layers": config.num_hidden_layers,
        "parameters": num_parameters(config), "dtype": "bfloat16", "mode": "corun",
        "decode_fused_combine": decode_fused_combine,
        "backend": "triton", "prefill_timing": "eager", "decode_timing": "cuda_graph",
        "build_s": round(build_s, 2),
        "logits_finite": finite,
        "prefill_len": prefill_len, "prefill_us": round(prefill_us, 1),
        "prefill_tokens_per_s": round(prefill_len / prefill_us * 1e6, 1),
        "decode_batch": decode_batch, "decode_context": context,
        "decode_step_us": round(decode_us, 1),
        "decode_tokens_per_s": round(decode_batch / decode_us * 1e6, 1),
        "decode_weight_bytes": int(weight_bytes), "decode_kv_bytes": int(kv_read),
        "decode_memory_bound_us": round(bound_us, 1),
        "decode_fraction_of_bound": round(bound_us / decode_us, 4),
        "peak_memory_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 2),
    }
    return record  # the model, cache and closures die with this frame; main() then frees


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(NAMED_CONFIGS))
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-fused-combine", action="store_true",
                        help="decode attention combines the splits in its split launch")
    parser.add_argument("--name", default=None, help="results name (default models-<card>)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_models needs a GPU (it runs real shapes in bf16)")
    if args.prefill_len + 1 > MAX_MODEL_LEN:
        raise SystemExit(f"--prefill-len: expected <= {MAX_MODEL_LEN - 1}")
    device = torch.device("cuda")
    result_name = args.name or f"models-{card_tag()}"
    records = []
    for name in args.models:
        record = bench_model(name, args.prefill_len, args.decode_batch, device,
                             args.decode_fused_combine)
        gc.collect()
        torch.cuda.empty_cache()
        print(record, flush=True)
        records.append(record)
        write_results(result_name, records)  # after each model, so a timeout keeps what finished
    print(f"wrote {write_results(result_name, records)}")


if __name__ == "__main__":
    main()
