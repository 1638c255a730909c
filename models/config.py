"""``ModelConfig``: the architecture facts a model needs, read once from a HF ``config.json``.

Model code never sees a transformers object. ``ModelConfig.from_hf`` reads both RoPE forms (the
Hub's top-level ``rope_theta`` + ``rope_scaling``, possibly with the legacy ``"type"`` key, and
transformers v5's ``rope_parameters``), normalises ``eos_token_id`` to a tuple and validates sizes
with ``ValueError`` naming the field.

``NAMED_CONFIGS`` is the one table of shapes, tiny (tests) through real (benchmarks, random
weights). ``*-l<N>`` entries keep the real per-layer shapes with fewer layers so they fit one
141 GB H200 in bf16 (see ``num_parameters``): qwen3-235b-a22b-l12 is 31.1 B parameters
(62 GB), deepseek-v3-l6 (3 dense + 3 MoE layers) is 38.1 B (76 GB), against 235 B / 671 B in full.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of one decoder-only model (HF field names where they exist).

    ``head_dim`` is explicit (never hidden / heads: Qwen3-30B-A3B attends at 32 x 128 = 4096 over
    a 2048 hidden). For DeepSeek-V3 it is the RoPE dim, as in HF; the MLA dims are separate.
    ``rope_scaling`` is None or a dict with ``rope_type`` (e.g. "yarn") and its parameters.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    # Mixture of experts (Qwen3-MoE and DeepSeek-V3).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    # Multi-head latent attention (DeepSeek-V3).
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture: unsupported {self.architecture!r}; expected one of {ARCHITECTURES}"
            )
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if not self.is_mla and self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok: expected 1..{self.num_experts}, "
                                 f"got {self.num_experts_per_tok}")
            if self.moe_intermediate_size < 1:
                raise ValueError(f"moe_intermediate_size: expected >= 1, "
                                 f"got {self.moe_intermediate_size}")
            if self.num_experts % self.n_group:
                raise ValueError(f"n_group: {self.n_group} does not divide num_experts "
                                 f"{self.num_experts}")
        if self.is_mla:
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name}: expected >= 1 for MLA, got {getattr(self, name)}")
        if self.rope_scaling is not None and "rope_type" not in self.rope_scaling:
            raise ValueError(f"rope_scaling: expected a 'rope_type' key, got {self.rope_scaling}")

    # ------------------------------------------------------------------ derived values

    @property
    def is_mla(self) -> bool:
        return self.architecture == "DeepseekV3ForCausalLM"

    @property
    def qk_head_dim(self) -> int:
        """Per-head q/k width: head_dim, or nope + rope for MLA (192 for DeepSeek-V3)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` has routed experts (else a dense MLP).

        Qwen3-MoE: not in mlp_only_layers and (idx + 1) % decoder_sparse_step == 0. DeepSeek-V3:
        idx >= first_k_dense_replace and idx % moe_layer_freq == 0 (vLLM; HF ignores the freq,
        which is 1 for V3 so the two agree on the real model).
        """
        if not self.num_experts:
            return False
        if self.is_mla:
            return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0
        return (layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def with_layers(self, num_hidden_layers: int) -> ModelConfig:
        """The same per-layer shapes at another depth (benchmarks of models too big for one GPU)."""
        return dataclasses.replace(self, num_hidden_layers=num_hidden_layers)

    # ------------------------------------------------------------------ HF config.json

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Build from a HF ``config.json`` dict (Hub or transformers-v5 form)."""
        architectures = config.get("architectures") or []
        if not architectures:
            raise ValueError("architectures: config.json names no architecture")
        theta, scaling = _read_rope(config)
        eos = config.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
        is_mla = architectures[0] == "DeepseekV3ForCausalLM"
        num_experts = config.get("num_experts") or config.get("n_routed_experts") or config.get(
            "num_local_experts") or 0
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("qk_rope_head_dim") if is_mla else config.get("head_dim")
        return cls(
            architecture=architectures[0],
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=head_dim or hidden // heads,
            intermediate_size=config["intermediate_size"],
            max_position_embeddings=config["max_position_embeddings"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=eos_ids,
            num_experts=num_experts,
            num_experts_per_tok=config.get("num_experts_per_tok", 0) if num_experts else 0,
            moe_intermediate_size=config.get("moe_intermediate_size", 0) if num_experts else 0,
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            decoder_sparse_step=config.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
            n_shared_experts=config.get("n_shared_experts") or 0,
            n_group=config.get("n_group") or 1,
            topk_group=config.get("topk_group") or 1,
            routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
            first_k_dense_replace=config.get("first_k_dense_replace") or 0,
            moe_layer_freq=config.get("moe_layer_freq") or 1,
            q_lora_rank=config.get("q_lora_rank"),
            kv_lora_rank=config.get("kv_lora_rank") or 0,
            qk_nope_head_dim=config.get("qk_nope_head_dim") or 0,
            qk_rope_head_dim=config.get("qk_rope_head_dim") or 0,
            v_head_dim=config.get("v_head_dim") or 0,
            rope_interleave=bool(config.get("rope_interleave", True)),
        )


def _read_rope(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either RoPE form.

    transformers v5 writes ``rope_parameters`` = {"rope_type", "rope_theta", factor, ...}; Hub
    files carry top-level ``rope_theta`` and ``rope_scaling`` whose type may sit under the legacy
    key ``"type"``. Both normalise to a dict with ``rope_type`` and no ``rope_theta``, or None for
    plain RoPE.
    """
    params = config.get("rope_parameters")
    if params:
        params = dict(params)
        theta = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    else:
        theta = config.get("rope_theta", 10000.0)
        params = dict(config["rope_scaling"]) if config.get("rope_scaling") else {}
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **params}


def num_parameters(config: ModelConfig) -> int:
    """Weight count of the model CoRun builds (for memory planning and benchmark bounds)."""
    h, v = config.hidden_size, config.vocab_size
    total = v * h * (1 if config.tie_word_embeddings else 2) + h  # embeddings, lm_head, final norm
    for layer in range(config.num_hidden_layers):
        total += 2 * h  # the two layer norms
        if config.is_mla:
            nh, qk = config.num_attention_heads, config.qk_head_dim
            if config.q_lora_rank:
                total += config.q_lora_rank * (h + 1) + nh * qk * config.q_lora_rank
            else:
                total += nh * qk * h
            total += (config.kv_lora_rank + config.qk_rope_head_dim) * h + config.kv_lora_rank
            total += nh * (config.qk_nope_head_dim + config.v_head_dim) * config.kv_lora_rank
            total += h * nh * config.v_head_dim
        else:
            q = config.num_attention_heads * config.head_dim
            kv = config.num_key_value_heads * config.head_dim
            total += (q + 2 * kv) * h + h * q + 2 * config.head_dim
        if config.is_moe_layer(layer):
            total += config.num_experts * (3 * config.moe_intermediate_size * h + h)
            total += 3 * config.n_shared_experts * config.moe_intermediate_size * h
            total += config.num_experts if config.is_mla else 0  # e_score_correction_bias
        else:
            total += 3 * config.intermediate_size * h
    return total


def _qwen3(**kw: Any) -> ModelConfig:
    defaults = dict(architecture="Qwen3ForCausalLM", rope_theta=1e6, max_position_embeddings=40960,
                    head_dim=128, bos_token_id=151643, eos_token_id=(151645, 151643),
                    vocab_size=151936)
    return ModelConfig(**{**defaults, **kw})


def _qwen3_moe(**kw: Any) -> ModelConfig:
    return _qwen3(architecture="Qwen3MoeForCausalLM", num_experts=128, num_experts_per_tok=8,
                  norm_topk_prob=True, **kw)


_DEEPSEEK_V3 = ModelConfig(
    architecture="DeepseekV3ForCausalLM", vocab_size=129280, hidden_size=7168,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, head_dim=64,
    intermediate_size=18432, max_position_embeddings=163840, rope_theta=10000.0,
    rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    bos_token_id=0, eos_token_id=(1,), num_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=2048, norm_topk_prob=True, n_shared_experts=1, n_group=8, topk_group=4,
    routed_scaling_factor=2.5, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
)

_QWEN3_235B = _qwen3_moe(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                         num_key_value_heads=4, intermediate_size=12288, moe_intermediate_size=1536)

NAMED_CONFIGS: dict[str, ModelConfig] = {
    # Tiny shapes for CPU tests (the interpreter is slow; every dim a power of two).
    "tiny-qwen3": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=256, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        max_position_embeddings=512, rope_theta=10000.0, bos_token_id=0, eos_token_id=(1,)),
    "tiny-qwen3-moe": ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=256, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        max_position_embeddings=512, rope_theta=10000.0, bos_token_id=0, eos_token_id=(1,),
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=(0,)),
    "tiny-deepseek-v3": ModelConfig(
        architecture="DeepseekV3ForCausalLM", vocab_size=256, hidden_size=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        intermediate_size=128, max_position_embeddings=512, rope_theta=10000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        bos_token_id=0, eos_token_id=(1,), num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, n_shared_experts=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16),
    # The server's embedded default: Qwen3-shaped for its byte-level tokenizer (ids 0..255 bytes,
    # 256 <|endoftext|>, 257 <|im_start|>, 258 <|im_end|>; vocab padded to 384).
    "corun-default": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=384, hidden_size=256, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, intermediate_size=768,
        max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=(256, 258)),
    # Real shapes (alibaba/InferSim hf_configs, cross-checked in notes/models-and-serving.md C.1).
    "qwen3-0.6b": _qwen3(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                         num_key_value_heads=8, intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-8b": _qwen3(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=12288),
    "qwen3-30b-a3b": _qwen3_moe(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                                num_key_value_heads=4, intermediate_size=6144,
                                moe_intermediate_size=768),
    "qwen3-235b-a22b": _QWEN3_235B,
    "deepseek-v3": _DEEPSEEK_V3,
    # Depth-truncated: same per-layer shapes, fits one H200 in bf16 (bytes in the module doc).
    "qwen3-235b-a22b-l12": _QWEN3_235B.with_layers(12),
    "deepseek-v3-l6": _DEEPSEEK_V3.with_layers(6),
}
