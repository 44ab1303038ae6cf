"""The model runner both worker kinds share: models, paged KV cache, scheduler, sampler.

Names are imported lazily, so that ``from pdserve.engine.sampling_params import ...`` or the
tokenizer does not pull in torch (the router uses those and never runs a model).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DEFAULT_MODEL": "pdserve.engine.config",
    "EngineConfig": "pdserve.engine.config",
    "ModelConfig": "pdserve.engine.config",
    "EngineStats": "pdserve.engine.engine",
    "LLMEngine": "pdserve.engine.engine",
    "LLM": "pdserve.engine.llm",
    "CompletionOutput": "pdserve.engine.llm",
    "GenerationResult": "pdserve.engine.llm",
    "RequestOutput": "pdserve.engine.request",
    "InvalidRequestError": "pdserve.engine.sampling_params",
    "SamplingParams": "pdserve.engine.sampling_params",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pdserve.engine' has no attribute {name!r}")
