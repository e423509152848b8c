"""``Components``: every piece of the engine a caller may replace, in one value (``LLM(model, components=...)``).

A course that builds the engine piece by piece hands its pieces in together: the seams vLLM has too
(``block_allocator``, ``scheduler``, ``attention_backend``, ``sampler``, ``verifier``, ``proposer``,
``quant_kernel``) and the model classes the loader builds (``model_registry``, vLLM's out-of-tree models: a model
built from other layer classes, e.g. a learner's RMSNorm, RoPE or decoder layer). A field left None keeps minifer's
reference, so one field set runs exactly one replaced piece. The value is frozen: the same components can build
several engines.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from minifer.attention.backends.paged import PagedAttentionBackend
    from minifer.core.kv_cache_manager import KVBlockAllocator
    from minifer.core.sched.scheduler import SchedulerPolicy
    from minifer.engine.speculative import SpeculativeConfig
    from minifer.quantization.linear import QuantKernel
    from minifer.sample.rejection_sampler import Verifier
    from minifer.sample.sampler import Sampler
    from minifer.spec_decode.metadata import DraftProposer

SEAMS = ("block_allocator", "scheduler", "sampler", "proposer", "verifier", "attention_backend")


@dataclass(frozen=True)
class Components:
    """The engine's replaceable pieces; None keeps the reference. The first six are ``LLM``'s seams of the same names,
    with the same contracts (``LLMEngine``'s docstring lists them); ``quant_kernel``:
    ``minifer.quantization.linear.QuantKernel``; ``model_registry``: an architecture name (``config.json``'s
    ``architectures``, ``"EagleHead"`` for an EAGLE head) -> the class built for it, as
    ``ModelRegistry.register_model(arch, cls)`` registers an out-of-tree model in vLLM, for this engine only: a
    subclass of ``LlamaForCausalLM`` (or ``EagleHead``) with the same parameters, e.g. built from other layer
    classes (``LlamaForCausalLM.layer_type``, ``norm_cls``, ...)."""

    sampler: Sampler | None = None
    attention_backend: Callable[..., PagedAttentionBackend] | None = None
    block_allocator: Callable[..., KVBlockAllocator] | None = None
    scheduler: Callable[..., SchedulerPolicy] | None = None
    proposer: DraftProposer | None = None
    verifier: Verifier | None = None
    quant_kernel: QuantKernel | None = None
    model_registry: Mapping[str, type[nn.Module]] | None = None

    def given(self) -> dict[str, Any]:
        """The fields that are set, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def model_cls(self, architecture: str, default: type[nn.Module]) -> type[nn.Module]:
        """The class to build for ``architecture``: the registered one, else ``default`` (minifer's). A registered class
        must extend ``default``: the loader fills the parameters ``default`` has, by name."""
        cls = (self.model_registry or {}).get(architecture, default)
        if not (isinstance(cls, type) and issubclass(cls, default)):
            raise TypeError(f"model_registry[{architecture!r}] must be a subclass of {default.__name__}, got {cls!r}")
        return cls


def merge_components(components: Components | None, **explicit: Any) -> Components:
    """``components`` with the seams also passed as ``LLM`` arguments added in; the same seam given both ways is
    refused (which of the two should run would be a guess)."""
    if components is None:
        components = Components()
    if not isinstance(components, Components):
        raise TypeError(f"components must be a minifer.engine.components.Components, got {type(components).__name__}")
    explicit = {k: v for k, v in explicit.items() if v is not None}
    both = sorted(set(explicit) & set(components.given()))
    if both:
        raise ValueError(f"{', '.join(both)} given both as an argument and in components: pass each piece once")
    return Components(**{**components.given(), **explicit})


def check_seams(batching: str, spec: SpeculativeConfig | None, **given: Any) -> dict[str, Any]:
    """The engine seams the caller handed in (``LLMEngine`` builds the others), after checking that they can apply."""
    seams = {name: value for name, value in given.items() if value is not None}
    if seams and batching != "continuous":
        raise ValueError(f"{', '.join(seams)} plug into the continuous engine: use batching='continuous'")
    if spec is None and {"proposer", "verifier"} & set(seams):
        raise ValueError("proposer and verifier are parts of speculative decoding: pass a speculative_config too "
                         "(its num_speculative_tokens is the k the proposer is asked for)")
    return seams
