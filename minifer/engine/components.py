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
    """The engine's replaceable pieces; None keeps the reference. The first six are the seams ``LLMEngine`` is built
    from (its ``components``; its docstring lists their contracts); ``quant_kernel``:
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


def as_components(components: Components | None) -> Components:
    """``components``, or every reference (``Components()``) for None; anything else is refused."""
    if components is None:
        return Components()
    if not isinstance(components, Components):
        raise TypeError(f"components must be a minifer.engine.components.Components, got {type(components).__name__}")
    return components


def check_seams(components: Components, batching: str, spec: SpeculativeConfig | None) -> None:
    """Refuse the engine seams set in ``components`` that cannot apply (``LLMEngine`` builds the others' reference)."""
    seams = [name for name in SEAMS if getattr(components, name) is not None]
    if seams and batching != "continuous":
        raise ValueError(f"{', '.join(seams)} plug into the continuous engine: use batching='continuous'")
    if spec is None and {"proposer", "verifier"} & set(seams):
        raise ValueError("proposer and verifier are parts of speculative decoding: pass a speculative_config too "
                         "(its num_speculative_tokens is the k the proposer is asked for)")
