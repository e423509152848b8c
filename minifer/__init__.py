"""minifer: a compact, readable LLM inference engine that the course notebooks build on.

The public names match vLLM's (``LLM``, ``SamplingParams``, ``RequestOutput``) so code written against
minifer moves to vLLM unchanged.
"""

from minifer.config import ModelConfig, UnsupportedModelError
from minifer.engine.beam_search import BeamSearchOutput, BeamSearchSequence
from minifer.engine.llm import LLM
from minifer.loader import BUNDLED_MODELS, ModelLoadError
from minifer.outputs import CompletionOutput, RequestOutput
from minifer.sampling import BeamSearchParams, Logprob, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "BeamSearchParams",
           "BeamSearchOutput", "BeamSearchSequence", "ModelConfig",
           "UnsupportedModelError", "ModelLoadError", "BUNDLED_MODELS", "__version__"]
