"""``Components``: every piece of the engine a caller may replace, in one value (``LLM(model, components=...)``).

A course that builds the engine piece by piece hands its pieces in together: the ``LLM`` seams
(``block_allocator``, ``scheduler``, ``sampler``, ...) and what the model runs in every layer (``LayerOps``:
RMSNorm, RoPE, the decoder layer's forward). A field left None keeps minifer's reference, so one field set runs
exactly one replaced piece. The value is frozen: the same components can build several engines.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from minifer.layers.ops import LayerOps

if TYPE_CHECKING:
    from minifer.core.kv_cache_manager import KVBlockAllocator
    from minifer.spec_decode.eagle import EagleForward
    from minifer.spec_decode.metadata import DraftProposer
    from minifer.core.sched.scheduler import SchedulerPolicy
    from minifer.engine.speculative import Rollback, SpeculativeConfig
    from minifer.engine.core import EngineStep
    from minifer.attention.backends.paged import PagedAttentionBackend
    from minifer.quantization.linear import QuantKernel
    from minifer.sample.sampler import Sampler
    from minifer.sample.rejection_sampler import Verifier

SEAMS = ("block_allocator", "scheduler", "sampler", "proposer", "verifier", "attention_backend", "rollback",
         "eagle_forward", "step")


@dataclass(frozen=True)
class Components:
    """The engine's replaceable pieces; None keeps the reference. ``rms_norm``, ``apply_rotary``, ``rope_inv_freq``
    and ``decoder_layer`` are ``LayerOps``' (``minifer.layers.ops``); the others are ``LLM``'s seams of the same names, with the same contracts
    (``LLMEngine``'s docstring lists them; ``quant_kernel``: ``minifer.quantization.linear.QuantKernel``; ``quantizer``:
    what the load path calls in place of ``minifer.quantization.model.quantize_model``)."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
    apply_rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    rope_inv_freq: Callable[[int, float], torch.Tensor] | None = None
    decoder_layer: Callable[..., torch.Tensor] | None = None
    sampler: Sampler | None = None
    attention_backend: Callable[..., PagedAttentionBackend] | None = None
    block_allocator: Callable[..., KVBlockAllocator] | None = None
    scheduler: Callable[..., SchedulerPolicy] | None = None
    proposer: DraftProposer | None = None
    verifier: Verifier | None = None
    quant_kernel: QuantKernel | None = None
    rollback: Rollback | None = None  # what a speculative step keeps of its drafts' KV (``speculative.Rollback``)
    eagle_forward: EagleForward | None = None  # the EAGLE head's forward (``features.eagle.EagleForward``)
    # what turns the loaded model's linear layers into QuantLinear ones: ``quantize_model``'s signature
    # (``quantizer(model, method, kernel=...)``, in place); None: ``minifer.quantization.model.quantize_model``
    quantizer: Callable[..., Any] | None = None
    step: EngineStep | None = None  # the whole engine step (minifer.engine.core), not speculating; no vLLM counterpart

    def given(self) -> dict[str, Any]:
        """The fields that are set, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def layer_ops(self) -> LayerOps | None:
        """The layers' functions, or None when all are the reference (the engine may then use CUDA graphs)."""
        if self.rms_norm is None and self.apply_rotary is None and self.decoder_layer is None \
                and self.rope_inv_freq is None:
            return None
        ref = LayerOps()
        return LayerOps(self.rms_norm or ref.rms_norm, self.apply_rotary or ref.apply_rotary, self.decoder_layer,
                        self.rope_inv_freq)


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
    if spec is not None and "step" in seams:
        raise ValueError("a given engine step runs the plain step (schedule, run, sample, append, free): speculative "
                         "decoding's step is the engine's own; drop speculative_config or the step")
    if spec is None and {"proposer", "verifier", "rollback", "eagle_forward"} & set(seams):
        raise ValueError("proposer and verifier are parts of speculative decoding (rollback and eagle_forward too): "
                         "pass a speculative_config too "
                         "(its num_speculative_tokens is the k the proposer is asked for)")
    return seams
