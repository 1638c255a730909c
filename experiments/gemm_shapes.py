"""The GEMMs the named models run, as tune_gemm sweeps them and bench_gemm times them: each
model's (label, N, K) read off a meta-device build, the M values of the sweep, and which models
the tuner, the kernels table and the portable peer's pool are about.
"""

from __future__ import annotations

import torch

from models.config import NAMED_CONFIGS

M_VALUES = (1, 8, 32, 64, 128, 256, 512, 2048, 8192)

# The models whose GEMMs the engine's benchmarks run, most important first (the budget cuts the
# tail): the headline's Qwen3-8B, the kernels table's 30B-A3B and DeepSeek-V3, then the rest of
# the real named configs (the paper's Qwen3-235B-A22B and Hy3, and Qwen3-0.6B).
TUNED_MODELS = ("qwen3-8b", "qwen3-30b-a3b", "deepseek-v3", "qwen3-235b-a22b", "hy3", "qwen3-0.6b")
BENCH_MODELS = TUNED_MODELS[:3]  # experiments/bench_gemm.py's table (issue 13's shapes)
# The portable batch-invariant peer's one config is chosen over this model's shapes (the
# headline's), where the whole pool is timed at every M.
POOL_MODEL = "qwen3-8b"


def _short_label(module_name: str, has_moe: bool) -> str:
    """``model.layers.0.self_attn.qkv_proj`` -> ``qkv``; a dense MLP of a MoE model is
    ``dense_gate_up`` / ``dense_down``, a shared expert ``shared.gate_up``."""
    parts = [p for p in module_name.split(".")
             if p not in ("model", "layers", "self_attn", "mlp") and not p.isdigit()]
    short = ".".join(parts).replace("_proj", "").replace("_with_mqa", "")
    short = short.replace("shared_experts.", "shared.")
    if short == "gate":  # a MoE layer's router
        return "router"
    if has_moe and module_name.split(".")[-2:-1] == ["mlp"]:
        short = f"dense_{short}"
    return short


def model_gemm_shapes(name: str) -> list[tuple[str, int, int]]:
    """(label, N, K) of every GEMM one model runs through ``kernels.gemm`` (its linear layers and
    the LM head), read off a meta-device build of its first layers: each dense, MoE and MLA layer
    kind once. MoE experts are the grouped GEMM's job (kernels/moe.py), not listed here."""
    from models import model_class
    from models.layers.embedding import LMHead
    from models.layers.linear import Linear
    from models.parallel import SINGLE

    config = NAMED_CONFIGS[name]
    depth = 1  # layers up to and including the first MoE layer (or all, if fewer)
    while depth < config.num_hidden_layers and not config.is_moe_layer(depth - 1):
        depth += 1
    config = config.with_layers(depth)
    with torch.device("meta"):
        model = model_class(config.architecture)(config, SINGLE)
    has_moe = any(config.is_moe_layer(i) for i in range(depth))
    shapes: dict[tuple[int, int], str] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, (Linear, LMHead)):
            n, k = module.weight.shape
            shapes.setdefault((n, k), f"{name}.{_short_label(module_name, has_moe)}")
    return [(label, n, k) for (n, k), label in shapes.items()]


def gemm_shapes(models: tuple[str, ...] = TUNED_MODELS) -> list[tuple[str, int, int]]:
    """(label, N, K) of the named models' GEMMs, each (N, K) once (its first model's label)."""
    seen: set[tuple[int, int]] = set()
    shapes = []
    for name in models:
        for label, n, k in model_gemm_shapes(name):
            if (n, k) not in seen:
                seen.add((n, k))
                shapes.append((label, n, k))
    return shapes


def models_shapes(shapes: tuple[tuple[str, int, int], ...], models: list[str],
                  by_label: bool = False) -> tuple[tuple[str, int, int], ...]:
    """The ``shapes`` that any of ``models`` runs: by (N, K) against each model's own GEMMs (a
    shape two models share carries its first model's label), or with ``by_label`` by the label's
    model prefix (the dry run's stand-in shapes)."""
    if by_label:
        return tuple(s for s in shapes if s[0].split(".", 1)[0] in models)
    wanted = {(n, k) for model in models for _, n, k in model_gemm_shapes(model)}
    return tuple(s for s in shapes if (s[1], s[2]) in wanted)
