"""The model runner both worker kinds share: models, paged KV cache, scheduler, sampler."""

from pdserve.engine.config import DEFAULT_MODEL, EngineConfig, ModelConfig
from pdserve.engine.engine import EngineStats, LLMEngine
from pdserve.engine.llm import LLM, CompletionOutput, GenerationResult
from pdserve.engine.request import RequestOutput
from pdserve.engine.sampling_params import InvalidRequestError, SamplingParams

__all__ = [
    "DEFAULT_MODEL",
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "GenerationResult",
    "InvalidRequestError",
    "LLMEngine",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
]
