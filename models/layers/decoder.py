"""The pre-norm decoder stack shared by every model, with HF module names
(``model.embed_tokens``, ``model.layers.{i}``, ``model.norm``, ``lm_head``) so weights load by
name. A model file only says how to build layer i's attention and MLP and what it caches.

The residual stream travels beside the hidden state: each norm adds it first and returns the sum
(``h = x + residual`` in the activation dtype, as the HF layers add), so the math is HF's.

Under tensor parallelism the model holds its ``ParallelContext`` (given at construction): the
residual stream and the norms are replicated on every rank (each layer ends in an all-reduce),
and ``compute_logits`` returns the full-vocabulary logits on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from models.config import ModelConfig
from models.forward_batch import ForwardBatch, KVCacheSpec, OpsConfig
from models.layers.embedding import LMHead, VocabEmbedding
from models.layers.norm import RMSNorm
from models.parallel import SINGLE, ParallelContext


class DecoderLayer(nn.Module):
    """``h = x + attn(norm(x)); out = h + mlp(norm(h))``; MoE MLPs also see the token mask."""

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module,
                 is_moe: bool) -> None:
        super().__init__()
        self.self_attn, self.mlp, self.is_moe = self_attn, mlp, is_moe
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = x, self.input_layernorm(x, batch.ops)
        else:
            h, residual = self.input_layernorm(x, batch.ops, residual)
        h = self.self_attn(h, batch)
        h, residual = self.post_attention_layernorm(h, batch.ops, residual)
        if self.is_moe:
            record = None
            if batch.routed_experts is not None:  # routing replay: the ids at the step's slots
                def record(ids: torch.Tensor) -> None:
                    batch.routed_experts.record(self.layer_idx, batch.slot_mapping, ids)
            return self.mlp(h, batch.ops, batch.token_mask, on_routing=record), residual
        return self.mlp(h, batch.ops), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, layers: list[DecoderLayer],
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, parallel)
        for index, layer in enumerate(layers):
            layer.layer_idx = index
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h, residual = self.embed_tokens(input_ids, batch.ops), None
        for layer in self.layers:
            h, residual = layer(h, residual, batch)
        h, _ = self.norm(h, batch.ops, residual)
        return h


class CausalLM(nn.Module):
    """Base of the model classes: ``forward(input_ids [T], batch) -> hidden [T, H]`` and a
    separate ``compute_logits`` (only the rows that sample pay for the vocabulary GEMM)."""

    # HF module name -> (our fused module name, shard index); matched on dotted components.
    packed_modules_mapping: dict[str, tuple[str, int]] = {}
    # A prefill step's forward is a pure function of the step's shape and device tensors, so it
    # can be captured as a CUDA graph. False where a layer sizes its work by host ints that change
    # from step to step at one shape (MLA expands each sequence's context).
    supports_prefill_graphs: bool = True
    # Checkpoint name -> our name, dotted fragments matched on whole components (transformers'
    # WeightRenaming of the family's Hub keys), applied before the mapping above.
    checkpoint_renames: dict[str, str] = {}

    def __init__(self, config: ModelConfig, layers: list[DecoderLayer],
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.config, self.parallel = config, parallel
        self.model = DecoderModel(config, layers, parallel)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, parallel)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config ties them (Qwen3-0.6B)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def kv_cache_spec(self) -> KVCacheSpec:
        raise NotImplementedError(f"{type(self).__name__} must define kv_cache_spec")

    def process_weights_after_loading(self) -> None:
        """Hook for derived weights (DeepSeek-V3 splits kv_b_proj); nothing for most models."""

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, batch)

    def compute_logits(self, hidden: torch.Tensor, ops: OpsConfig | None = None) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32. Pass the step's ``ops`` for the mode's
        invariance (the torch backend under batch_invariant tiles the GEMM); without it, a plain
        matmul, position-invariant at a fixed N."""
        return self.lm_head(hidden, ops)
