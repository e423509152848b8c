"""The decoder compiled by ``torch.compile`` (inductor), attention left opaque: the CPU's fused layer path (issue 28).

At batch 1 on a small model, a decode step is not limited by arithmetic or by memory but by the ~25 separate
eager ops each layer runs around its two matmuls (RMSNorm, the q/k/v split, RoPE, SwiGLU, residual adds): every op
is a dispatch, an allocation and a pass over a tiny tensor. ``torch.compile`` traces the model's own eager code once
and inductor fuses those element-wise ops into a few C++ loops, as vLLM compiles its models by default.

Attention is the part that cannot be traced: it reads and writes the paged cache through per-step metadata built
in Python. As vLLM does, the graph calls it through one opaque custom op (``minifer::attend``) that looks up the
step's attention backend in ``_current``, set around every compiled call (vLLM's "forward context"). The graph
therefore does not depend on which cache or engine runs it, and the token count is a dynamic dimension, so a
varied workload compiles a bounded number of graphs (one for a single token, one for any other count) instead
of one per step. Weights stay module parameters the graph reads; with ``freezing`` inductor folds them in as
constants, once, when it compiles.

Dynamo checks guards before every call to pick a graph, by default on every parameter of every layer: at batch 1
that check cost more than a millisecond a step here, a large part of what compiling saves. As vLLM does, the guards
on the modules are dropped (``skip_guard_on_all_nn_modules_unsafe``; the input shapes are still checked). That is
safe only if no other model can reach these graphs, so each ``CompiledDecoder`` traces a function with its own code
object (dynamo keeps its graphs per code object): two compiled models in one process never share a graph.

This is a switch (``LLM(compilation_config={"level": 3})``; ``enforce_eager=True`` keeps the eager model): the model
a learner reads is the eager one, and the suite checks that both give the same greedy tokens. Measured alone through
the engine (``benchmarks/results/cpu_peer.json`` at 02ed262) it pays where overhead dominates, 1.19x at batch 1, and
not at 16-64 slots (0.91x, 0.94x), where the step is its matrix products, attention's gathers and the engine's own
work; compiling also takes tens of seconds, so it is off by default.
"""

from __future__ import annotations

import types
from contextlib import contextmanager

import torch

from minifer.layers.ops import REFERENCE_OPS

_current: list = []  # the attention backend of the forward in progress (a stack: a drafter may run inside)


@torch.library.custom_op("minifer::attend", mutates_args=())
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """``AttentionBackend.attend`` of the step's backend, as one op the compiler does not look into. It writes the
    step's keys and values into that backend's cache (which is not an input of the graph, so no mutation to declare)."""
    return _current[-1].attend(layer, q, k, v)


@attend.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)


class _OpaqueAttention:
    """The backend the traced model sees: every layer's ``attend`` becomes a call of the custom op."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(q, k, v, layer)


@contextmanager
def forward_context(backend):
    _current.append(backend)
    try:
        yield
    finally:
        _current.pop()


class CompiledDecoder:
    """The compiled forward of one ``LlamaModel`` (the decoder without ``lm_head``), for ``LlamaForCausalLM.forward``.
    Steps with other layer functions than minifer's own (a learner's ``LayerOps``) run the eager model."""

    def __init__(self, decoder: torch.nn.Module, freezing: bool = True) -> None:
        self.decoder = decoder
        trace = _own_code(_tracer(decoder, _OpaqueAttention()), f"decoder_{id(self):x}")
        self._compiled = torch.compile(trace, dynamic=True, options={
            "freezing": freezing, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})

    def applies(self, ops) -> bool:
        return ops == REFERENCE_OPS and not torch.is_grad_enabled()  # the reference functions, by value

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        with forward_context(attn):
            return self._compiled(input_ids, positions)


def _tracer(decoder: torch.nn.Module, opaque: _OpaqueAttention):
    def trace(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return decoder(input_ids, positions, opaque, REFERENCE_OPS)
    return trace


def _own_code(fn, name: str):
    """``fn`` with a code object of its own (see the module docstring: it keeps this model's graphs to itself)."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def compile_decoder(model: torch.nn.Module, freezing: bool = True) -> CompiledDecoder:
    """Attach a ``CompiledDecoder`` to ``model`` (a ``LlamaForCausalLM``): its forward uses it from then on, where
    it applies. Compilation itself happens at the first forward of each graph (one token, several tokens)."""
    model.compiled = CompiledDecoder(model.model, freezing)
    return model.compiled
