"""Shared drivers of the model tests: one sequence through our model (prefill then decode steps
over a paged cache) and through transformers (its DynamicCache), logits compared by
max|diff| / max|ref|."""

from __future__ import annotations

from pathlib import Path

import torch

from models.forward_batch import ForwardBatch, KVCache, OpsConfig

BLOCK_SIZE = 8  # the smallest the Triton attention kernels take; prompts span 2+ blocks


def run_sequence(model: torch.nn.Module, prompt: torch.Tensor, decode_ids: torch.Tensor,
                 ops: OpsConfig, max_seq_len: int = 64) -> list[torch.Tensor]:
    """Logits [T, V] of the prompt, then [1, V] per decode token, over a fresh paged cache.

    The sequence's blocks are laid out in reverse order in the cache so that a wrong block-table
    lookup cannot pass by accident.
    """
    num_blocks = max_seq_len // BLOCK_SIZE
    dtype = next(model.parameters()).dtype
    cache = KVCache(model.kv_cache_spec(), num_blocks, BLOCK_SIZE, dtype, "cpu")
    block_table = torch.arange(num_blocks - 1, -1, -1, dtype=torch.int32).view(1, -1)

    def slots(positions: torch.Tensor) -> torch.Tensor:
        return block_table[0, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE

    t = prompt.shape[0]
    positions = torch.arange(t)
    batch = ForwardBatch(
        is_prefill=True, positions=positions, slot_mapping=slots(positions),
        block_tables=block_table, kv_cache=cache, ops=ops,
        cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32),
        context_lens=torch.tensor([t], dtype=torch.int32), max_q_len=t,
        token_mask=torch.ones(t, dtype=torch.bool))
    outputs = [model.compute_logits(model(prompt, batch), ops)]
    for step, token in enumerate(decode_ids.tolist()):
        pos = torch.tensor([t + step])
        batch = ForwardBatch(
            is_prefill=False, positions=pos, slot_mapping=slots(pos), block_tables=block_table,
            kv_cache=cache, ops=ops, seq_lens=torch.tensor([t + step + 1], dtype=torch.int32),
            max_seq_len=max_seq_len, token_mask=torch.ones(1, dtype=torch.bool))
        outputs.append(model.compute_logits(model(torch.tensor([token]), batch), ops))
    return outputs


@torch.no_grad()
def run_hf_sequence(hf_model: torch.nn.Module, prompt: torch.Tensor,
                    decode_ids: torch.Tensor) -> list[torch.Tensor]:
    """The same sequence through transformers with its KV cache (DynamicCache)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf_model.config)
    out = hf_model(input_ids=prompt.view(1, -1), past_key_values=cache, use_cache=True)
    outputs = [out.logits[0].float()]
    for token in decode_ids.tolist():
        out = hf_model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values,
                       use_cache=True)
        outputs.append(out.logits[0].float())
    return outputs


def relative_error(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """max over steps of max|ours - ref| / max|ref|."""
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(ours, ref, strict=True))


def save_hf(hf_model: torch.nn.Module, tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    hf_model.save_pretrained(path)
    return path


def randomize_biases(model) -> None:
    """transformers initialises biases to 0, which would hide a bias that is never added."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)


def save_named_checkpoint(name: str, seed: int, path: Path, **config_overrides) -> Path:
    """A HF directory of a Qwen3-architecture named config (config.json in Qwen3's keys,
    ``config_overrides`` applied) holding that config's random weights drawn from ``seed``
    under checkpoint names: what ``load_model`` and ``LLM.update_weights`` read."""
    import dataclasses
    import json

    from safetensors.torch import save_file

    from models import NAMED_CONFIGS, build_model
    from models.loader import checkpoint_views

    config = dataclasses.asdict(NAMED_CONFIGS[name])
    if config["architecture"] != "Qwen3ForCausalLM":
        raise ValueError(f"{name}: only Qwen3-architecture configs are written here")
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings",
            "rms_norm_eps", "rope_theta", "tie_word_embeddings", "attention_bias",
            "bos_token_id")
    hf = {key: config[key] for key in keys}
    hf.update(architectures=["Qwen3ForCausalLM"], eos_token_id=list(config["eos_token_id"]),
              **config_overrides)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hf))
    model = build_model(name, dtype=torch.float32, device="cpu", seed=seed)[0]
    # Tied weights are one tensor: save_file refuses shared storage, so each is its own copy.
    save_file({k: v.contiguous().clone() for k, v in checkpoint_views(model).items()},
              path / "model.safetensors")
    return path


def engine_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """log_softmax of ``engine``'s model's logits over the whole of ``ids``, [L, V] fp64: the
    reference a served logprob is compared with."""
    runner = engine.runner
    with torch.inference_mode():
        logits = run_sequence(runner.model, torch.tensor(ids), torch.tensor([]), runner.ops,
                              max_seq_len=engine.config.max_model_len)[0]
    return torch.log_softmax(logits.double(), -1)
