"""minifer: a compact, readable LLM inference engine that the course notebooks build on.

The public names match vLLM's (``LLM``, ``SamplingParams``, ``RequestOutput``) so code written against
minifer moves to vLLM unchanged.

They are imported on first use (PEP 562's module ``__getattr__``): ``import minifer`` alone loads neither torch
nor transformers, so the server's argument parsing, the course's installation check and a tool that needs one
submodule start fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "minifer.entrypoints.llm", "EngineArgs": "minifer.engine.arg_utils",
    "SamplingParams": "minifer.sampling_params", "BeamSearchParams": "minifer.sampling_params",
    "Logprob": "minifer.sampling_params",
    "RequestOutput": "minifer.outputs", "CompletionOutput": "minifer.outputs",
    "BeamSearchOutput": "minifer.beam_search", "BeamSearchSequence": "minifer.beam_search",
    "ModelConfig": "minifer.config", "UnsupportedModelError": "minifer.config",
    "ModelLoadError": "minifer.model_loader", "BUNDLED_MODELS": "minifer.model_loader",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    from minifer.beam_search import BeamSearchOutput, BeamSearchSequence
    from minifer.config import ModelConfig, UnsupportedModelError
    from minifer.engine.arg_utils import EngineArgs
    from minifer.entrypoints.llm import LLM
    from minifer.model_loader import BUNDLED_MODELS, ModelLoadError
    from minifer.outputs import CompletionOutput, RequestOutput
    from minifer.sampling_params import BeamSearchParams, Logprob, SamplingParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'minifer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # imported once: later look-ups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
