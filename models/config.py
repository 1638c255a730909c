"""``ModelConfig``: the architecture facts a model needs, read once from a HF ``config.json``.

Model code never sees a transformers object. ``ModelConfig.from_hf`` reads both RoPE forms (the
Hub's top-level ``rope_theta`` + ``rope_scaling``, possibly with the legacy ``"type"`` key, and
transformers v5's ``rope_parameters``), normalises ``eos_token_id`` to a tuple and validates sizes
with ``ValueError`` naming the field. Hy3 (``HYV3ForCausalLM``) fields missing from a config.json
take transformers' ``HYV3Config`` defaults (RoPE theta 11158840, fp32 combine on, one shared
expert, router scale 2.826, first layer dense), as transformers itself would load it.

``NAMED_CONFIGS`` is the one table of shapes, tiny (tests) through real (benchmarks, random
weights). ``*-l<N>`` entries keep the real per-layer shapes with fewer layers so they fit one
141 GB H200 in bf16 (see ``num_parameters``): qwen3-235b-a22b-l12 is 31.1 B parameters
(62 GB), deepseek-v3-l6 (3 dense + 3 MoE layers) is 38.1 B (76 GB), hy3-l14 (1 dense + 13 MoE
layers) is 49.6 B (99.2 GB), against 235 B / 671 B / 295 B in full.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM",
                 "HYV3ForCausalLM")
MLP_LAYER_TYPES = ("dense", "sparse")  # Hy3's per-layer MLP kinds
HY3_DEFAULT_ROPE_THETA = 11_158_840.0  # transformers HYV3Config.default_theta


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
    # Mixture of experts (Qwen3-MoE, DeepSeek-V3 and Hy3; Hy3 reuses DeepSeek's names: one group,
    # n_shared_experts = num_shared_experts, routed_scaling_factor = router_scaling_factor).
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
    # Hy3: "dense" / "sparse" per layer (empty: not given), and whether the shared expert's output
    # is added to the routed output in fp32 (``enable_moe_fp32_combine``).
    mlp_layer_types: tuple[str, ...] = ()
    enable_moe_fp32_combine: bool = False
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
        if self.architecture == "HYV3ForCausalLM" and not self.mlp_layer_types:
            raise ValueError("mlp_layer_types: required for HYV3ForCausalLM (dense/sparse per "
                             "layer)")
        if self.mlp_layer_types:
            if len(self.mlp_layer_types) != self.num_hidden_layers:
                raise ValueError(f"mlp_layer_types: {len(self.mlp_layer_types)} entries for "
                                 f"{self.num_hidden_layers} layers")
            if any(t not in MLP_LAYER_TYPES for t in self.mlp_layer_types):
                raise ValueError(f"mlp_layer_types: expected entries in {MLP_LAYER_TYPES}, "
                                 f"got {sorted(set(self.mlp_layer_types))}")
            if "sparse" in self.mlp_layer_types and not self.num_experts:
                raise ValueError("mlp_layer_types: sparse layers need num_experts >= 1")
        if self.rope_scaling is not None and "rope_type" not in self.rope_scaling:
            raise ValueError(f"rope_scaling: expected a 'rope_type' key, got {self.rope_scaling}")

    # ------------------------------------------------------------------ derived values

    @property
    def max_sequence_length(self) -> int:
        """The longest sequence the position encoding serves: ``max_position_embeddings``, or
        under YaRN ``original_max_position_embeddings x factor`` when that is longer (vLLM's
        rule: Qwen3's opt-in YaRN keeps 40960 in the config for 4 x 32768 positions)."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") == "yarn" and "factor" in scaling:
            original = scaling.get("original_max_position_embeddings",
                                   self.max_position_embeddings)
            return max(self.max_position_embeddings, int(original * scaling["factor"]))
        return self.max_position_embeddings

    @property
    def is_mla(self) -> bool:
        return self.architecture == "DeepseekV3ForCausalLM"

    @property
    def has_expert_bias(self) -> bool:
        """Sigmoid router with an ``e_score_correction_bias`` (DeepSeek-V3, Hy3)."""
        return self.architecture in ("DeepseekV3ForCausalLM", "HYV3ForCausalLM")

    @property
    def qk_head_dim(self) -> int:
        """Per-head q/k width: head_dim, or nope + rope for MLA (192 for DeepSeek-V3)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` has routed experts (else a dense MLP).

        Qwen3-MoE: not in mlp_only_layers and (idx + 1) % decoder_sparse_step == 0. DeepSeek-V3:
        idx >= first_k_dense_replace and idx % moe_layer_freq == 0 (vLLM; HF ignores the freq,
        which is 1 for V3 so the two agree on the real model). Hy3: mlp_layer_types[idx].
        """
        if not self.num_experts:
            return False
        if self.mlp_layer_types:
            return self.mlp_layer_types[layer_idx] == "sparse"
        if self.is_mla:
            return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0
        return (layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def with_layers(self, num_hidden_layers: int) -> ModelConfig:
        """The same per-layer shapes at another depth (benchmarks of models too big for one GPU):
        the first ``num_hidden_layers`` layers, their MLP kinds included."""
        layer_types = self.mlp_layer_types[:num_hidden_layers] if self.mlp_layer_types else ()
        return dataclasses.replace(self, num_hidden_layers=num_hidden_layers,
                                   mlp_layer_types=layer_types)

    # ------------------------------------------------------------------ HF config.json

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Build from a HF ``config.json`` dict (Hub or transformers-v5 form)."""
        architectures = config.get("architectures") or []
        if not architectures:
            raise ValueError("architectures: config.json names no architecture")
        _check_runnable(config)
        is_mla = architectures[0] == "DeepseekV3ForCausalLM"
        # transformers' config-class defaults for keys a config.json leaves out.
        missing = _HF_DEFAULTS.get(architectures[0], {})

        def get(key: str, fallback: Any) -> Any:
            value = config.get(key, missing.get(key))
            return fallback if value is None else value

        is_hy3 = architectures[0] == "HYV3ForCausalLM"
        theta, scaling = _read_rope(config, HY3_DEFAULT_ROPE_THETA if is_hy3 else 10000.0)
        eos = config.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
        num_experts = config.get("num_experts") or config.get("n_routed_experts") or config.get(
            "num_local_experts") or 0
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("qk_rope_head_dim") if is_mla else get("head_dim", None)
        fields = dict(
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
            norm_topk_prob=bool(get("norm_topk_prob", False)),
            decoder_sparse_step=config.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
            n_shared_experts=get("n_shared_experts", 0),
            n_group=get("n_group", 1),
            topk_group=get("topk_group", 1),
            routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=get("first_k_dense_replace", 0),
            moe_layer_freq=config.get("moe_layer_freq") or 1,
            q_lora_rank=config.get("q_lora_rank"),
            kv_lora_rank=config.get("kv_lora_rank") or 0,
            qk_nope_head_dim=config.get("qk_nope_head_dim") or 0,
            qk_rope_head_dim=config.get("qk_rope_head_dim") or 0,
            v_head_dim=config.get("v_head_dim") or 0,
            rope_interleave=bool(config.get("rope_interleave", True)),
        )
        if is_hy3:
            fields.update(_hy3_fields(config))
        return cls(**fields)


# What transformers' config classes assume for a key config.json leaves out, where it differs
# from what an absent key means here (DeepseekV3Config, Qwen3Config; v5.23). Hy3's are applied
# by _hy3_fields.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen3ForCausalLM": {"head_dim": 128},
    "DeepseekV3ForCausalLM": {"n_group": 8, "topk_group": 4, "norm_topk_prob": True,
                              "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
                              "n_shared_experts": 1},
}


def _check_runnable(config: Mapping[str, Any]) -> None:
    """ValueError, naming the key, for what a config.json may ask and the models do not build
    (the model would otherwise load and compute something else)."""
    quantization = config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "quantized") if isinstance(
            quantization, Mapping) else "quantized"
        raise ValueError(f"quantization_config: {method} checkpoints are not supported (the "
                         f"models load 16- or 32-bit weights; dequantize the checkpoint first)")
    if config.get("use_sliding_window"):
        raise ValueError("use_sliding_window: sliding-window attention is not supported")
    activation = config.get("hidden_act", "silu")
    if activation not in ("silu", "swish"):
        raise ValueError(f"hidden_act: {activation!r} is not supported (the MLPs compute SiLU)")


def _hy3_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The Hy3 fields, with transformers ``HYV3Config``'s defaults where config.json omits one.

    transformers' router always renormalises the top-k and never groups experts, so
    norm_topk_prob is True and n_group = topk_group = 1 whatever the file says. The MLP kinds come
    from ``mlp_layer_types`` (every v5 save writes it); a Hub file without it has
    ``first_k_dense_replace`` dense layers first (HYV3Config ignores that key and makes one layer
    dense; the official files set it to 1, so the two agree there). Pre-v5 files name the expert
    width ``expert_hidden_dim``. Biased MLPs are not built: ValueError.
    """
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias: Hy3 MLPs with biases are not supported")
    layers = config["num_hidden_layers"]
    first_dense = min(config.get("first_k_dense_replace", 1), layers)
    layer_types = config.get("mlp_layer_types") or (
        ["dense"] * first_dense + ["sparse"] * (layers - first_dense))
    num_experts = config.get("num_experts") or config.get("num_local_experts") or 192
    shared = config.get("num_shared_experts")
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=config.get("num_experts_per_tok") or 8,
        moe_intermediate_size=(config.get("moe_intermediate_size")
                               or config.get("expert_hidden_dim") or 1536),
        norm_topk_prob=True, n_group=1, topk_group=1,
        n_shared_experts=1 if shared is None else shared,
        routed_scaling_factor=float(config.get("router_scaling_factor", 2.826)),
        mlp_layer_types=tuple(layer_types), first_k_dense_replace=0,  # the types carry it
        enable_moe_fp32_combine=bool(config.get("enable_moe_fp32_combine", True)),
        rms_norm_eps=config.get("rms_norm_eps", 1e-5),
    )


def _read_rope(config: Mapping[str, Any],
               default_theta: float = 10000.0) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either RoPE form.

    transformers v5 writes ``rope_parameters`` = {"rope_type", "rope_theta", factor, ...}; Hub
    files carry top-level ``rope_theta`` and ``rope_scaling`` whose type may sit under the legacy
    key ``"type"``. Both normalise to a dict with ``rope_type`` and no ``rope_theta``, or None for
    plain RoPE. ``default_theta`` when neither form gives a theta (the HF config class default).
    """
    params = config.get("rope_parameters")
    if params:
        params = dict(params)
        theta = params.pop("rope_theta", config.get("rope_theta", default_theta))
    else:
        theta = config.get("rope_theta", default_theta)
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
            total += config.num_experts if config.has_expert_bias else 0  # correction bias
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

# Hy3-preview (transformers HYV3Config defaults; the official config.json agrees except
# max_position_embeddings, 262144 there; eos 120025 from its generation_config.json).
_HY3 = ModelConfig(
    architecture="HYV3ForCausalLM", vocab_size=120832, hidden_size=4096, num_hidden_layers=80,
    num_attention_heads=64, num_key_value_heads=8, head_dim=128, intermediate_size=13312,
    max_position_embeddings=262144, rms_norm_eps=1e-5, rope_theta=HY3_DEFAULT_ROPE_THETA,
    eos_token_id=(120025,), num_experts=192, num_experts_per_tok=8, moe_intermediate_size=1536,
    norm_topk_prob=True, n_shared_experts=1, routed_scaling_factor=2.826,
    mlp_layer_types=("dense",) + ("sparse",) * 79, enable_moe_fp32_combine=True,
)

_QWEN3_235B = _qwen3_moe(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                         num_key_value_heads=4, intermediate_size=12288, moe_intermediate_size=1536)

NAMED_CONFIGS: dict[str, ModelConfig] = {
    # Tiny shapes for CPU tests (the interpreter is slow; every dim a power of two), with room
    # for EngineConfig's default max_model_len (2048).
    "tiny-qwen3": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=256, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        max_position_embeddings=4096, rope_theta=10000.0, bos_token_id=0, eos_token_id=(1,)),
    "tiny-qwen3-moe": ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=256, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        max_position_embeddings=4096, rope_theta=10000.0, bos_token_id=0, eos_token_id=(1,),
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=(0,)),
    "tiny-deepseek-v3": ModelConfig(
        architecture="DeepseekV3ForCausalLM", vocab_size=256, hidden_size=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        intermediate_size=128, max_position_embeddings=4096, rope_theta=10000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        bos_token_id=0, eos_token_id=(1,), num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, n_shared_experts=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16),
    "tiny-hy3": ModelConfig(
        architecture="HYV3ForCausalLM", vocab_size=256, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=0,
        eos_token_id=(1,), num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, n_shared_experts=1, routed_scaling_factor=2.826,
        mlp_layer_types=("dense", "sparse"), enable_moe_fp32_combine=True),
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
    "hy3": _HY3,
    # Depth-truncated: same per-layer shapes, fits one H200 in bf16 (bytes in the module doc).
    "qwen3-235b-a22b-l12": _QWEN3_235B.with_layers(12),
    "deepseek-v3-l6": _DEEPSEEK_V3.with_layers(6),
    # 14 layers (the dense layer 0 + 13 MoE layers, 3.72 B parameters each): 99.2 GB of bf16
    # weights, leaving ~42 GB of the 141 GB for the KV cache and activations. The 1000-request
    # offline run (prompts <= 2048, 256 outputs, 128 sequences at once) holds at most
    # 128 x 2304 tokens x 57 KB (14 layers x 8 kv heads x 128 x K|V x 2 bytes) = 16.9 GB of KV;
    # a 15th layer would leave ~34 GB.
    "hy3-l14": _HY3.with_layers(14),
}
