"""The decoder compiled by ``torch.compile`` (inductor), attention left opaque: the CPU's fused layer path.

At batch 1 on a small model a decode step is bound neither by arithmetic nor by memory but by the ~25 small eager
ops each layer runs around its two matmuls (RMSNorm, the q/k/v split, RoPE, SwiGLU, residual adds), each a
dispatch, an allocation and a pass over a tiny tensor. Inductor fuses them into a few C++ loops, as vLLM compiles
its models by default.

Attention cannot be traced: it reads the paged cache through per-step metadata built in Python. As in vLLM, the
graph calls it through one opaque custom op (``minifer::attend``) that finds the step's backend in ``_current``,
set around every call (vLLM's "forward context"), so the graph does not depend on the cache or engine that runs it.
The token count is a dynamic dimension: two graphs (one token, any other count), not one per step. With
``freezing`` inductor folds the weights in as constants when it compiles.

Dynamo's guards on the modules' parameters are dropped (``skip_guard_on_all_nn_modules_unsafe``, as vLLM does;
input shapes are still checked): checked before every call, they cost much of what compiling saves at batch 1. That
is safe only if no other model reaches these graphs, so each ``CompiledDecoder`` traces a function with its own
code object (dynamo keeps graphs per code object).

A switch, off by default (``LLM(compilation_config={"level": 3})``; compiling takes tens of seconds;
``enforce_eager`` keeps the eager model, the one a learner reads): the suite checks that both give the same greedy
tokens. It pays where per-op overhead dominates (batch 1), not where a step is its matrix products
(``benchmarks/results/cpu_peer.json``).
"""

from __future__ import annotations

import types
from contextlib import contextmanager

import torch

_current: list = []  # the attention backend of the forward in progress (a stack: a drafter may run inside)


@torch.library.custom_op("minifer::attend", mutates_args=())
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """The step's ``AttentionBackend.attend`` as one op the compiler does not look into. The cache it writes is not
    a graph input, so there is no mutation to declare."""
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
    Steps that track gradients run the eager model."""

    def __init__(self, decoder: torch.nn.Module, freezing: bool = True) -> None:
        self.decoder = decoder
        trace = _own_code(_tracer(decoder, _OpaqueAttention()), f"decoder_{id(self):x}")
        self._compiled = torch.compile(trace, dynamic=True, options={
            "freezing": freezing, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})

    def applies(self) -> bool:
        return not torch.is_grad_enabled()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        with forward_context(attn):
            return self._compiled(input_ids, positions)


def _tracer(decoder: torch.nn.Module, opaque: _OpaqueAttention):
    def trace(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return decoder(input_ids, positions, opaque)
    return trace


def _own_code(fn, name: str):
    """``fn`` with a code object of its own, so this model's graphs are its own (see the module docstring)."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def compile_decoder(model: torch.nn.Module, freezing: bool = True) -> CompiledDecoder:
    """Attach a ``CompiledDecoder`` to ``model`` (a ``LlamaForCausalLM``): its forward uses it from then on, where
    it applies. Compilation itself happens at the first forward of each graph (one token, several tokens)."""
    model.compiled = CompiledDecoder(model.model, freezing)
    return model.compiled
