"""CoRun: deterministic LLM inference by scheduling (DESIGN.md).

``from corun import LLM, SamplingParams`` for offline generation; ``LLMEngine`` is the step-level
API the server builds on. Exports are resolved lazily so the pure-Python parts (config, scheduler,
block manager) import without torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "corun.llm",
    "LLMEngine": "corun.engine",
    "QueueFullError": "corun.engine",
    "EngineConfig": "corun.config",
    "SamplingParams": "corun.sampling_params",
    "StructuredOutput": "corun.structured_output",
    "RequestOutput": "corun.outputs",
    "CompletionOutput": "corun.outputs",
    "ScoreOutput": "corun.outputs",
    "Tokenizer": "corun.tokenizer",
    "Mode": "kernels.mode",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'corun' has no attribute {name!r}")
