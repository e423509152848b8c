"""The grader of exercise 05's load step: ``quantize_linears(model, quantize, group_size, symmetric, kernel)`` turns a
loaded model's float projections into ``QuantLinear`` layers, in place.

The learner's function runs on copies of the bundled ``tinystories-target`` (float32), with minifer's quantizer
handed in (so that only the load step is graded), and is compared with ``minifer.quantization.model.quantize_model`` on
another copy: which modules became ``QuantLinear`` (the decoder projections, not ``lm_head`` nor the embeddings),
their shapes and groups (``[N, K]``, groups along K, ``group_for``'s fallback for ``down_proj``), their bytes, their
biases (on a copy given biases: the bundled model has none), the kernel they multiply through, the bytes the model
still holds (a float weight left resident is as large as the model it was meant to shrink), and the logits.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from minifer_course.grading.base import Check, run_checks, seeded


@functools.lru_cache(maxsize=1)
def _float_model() -> nn.Module:
    import minifer

    return minifer.LLM("tinystories-target", device="cpu").model  # float32: the same numbers on every machine


def _with_biases(model: nn.Module) -> nn.Module:
    """A copy whose first layer's ``qkv_proj`` and ``down_proj`` have a bias (as Qwen2's ``qkv_proj`` has)."""
    model = copy.deepcopy(model)
    gen = seeded(55)
    layer = model.model.layers[0]
    for parent, child in ((layer.self_attn, "qkv_proj"), (layer.mlp, "down_proj")):
        old = getattr(parent, child)
        new = nn.Linear(old.in_features, old.out_features, bias=True)
        with torch.no_grad():
            new.weight.copy_(old.weight)
            new.bias.copy_(torch.randn(old.out_features, generator=gen) * 0.05)
        setattr(parent, child, new)
    return model


def _minifers_quantize(w: torch.Tensor, group_size: int, symmetric: bool):
    from minifer.quantization.formats import quantize_int4

    qw = quantize_int4(w, group_size, symmetric)
    return qw.qweight, qw.scales, qw.zeros


def _marked_kernel(x: torch.Tensor, qw: Any, bias: torch.Tensor | None) -> torch.Tensor:
    """The reference kernel under another name: the grader checks each layer was handed the kernel it was given."""
    from minifer.quantization.formats import quant_linear_reference

    return quant_linear_reference(x, qw, bias)


def _model_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of every tensor the model holds (parameters and buffers, each storage once), by name."""
    out, seen = {}, set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[name] = t.numel() * t.element_size()
    return out


def _logits(model: nn.Module) -> torch.Tensor:
    from minifer.eval import causal_forward

    ids = torch.randint(1, 2048, (2, 12), generator=seeded(56))
    with torch.inference_mode():
        return model.compute_logits(causal_forward(model, ids)).float()


def check_quantize_linears(fn: Callable[..., Any]) -> None:
    """Grade ``fn(model, quantize, group_size, symmetric, kernel)`` against ``quantize_model`` (int4)."""
    from minifer.quantization.linear import QuantLinear, decoder_linears
    from minifer.quantization.model import quantize_model

    done: dict[tuple[bool, bool], tuple[nn.Module, nn.Module]] = {}

    def pair(symmetric: bool, biases: bool = False) -> tuple[nn.Module, nn.Module]:
        """(the learner's model, minifer's) quantized at g128 from the same float copy."""
        if (symmetric, biases) not in done:
            base = _with_biases(_float_model()) if biases else _float_model()
            mine, ref = copy.deepcopy(base), copy.deepcopy(base)
            got = fn(mine, _minifers_quantize, 128, symmetric, _marked_kernel)
            if isinstance(got, nn.Module) and got is not mine:
                raise AssertionError("quantize_linears changes the model in place (the engine keeps the model it "
                                     "loaded): swap the modules inside `model` and return None")
            quantize_model(ref, "int4", 128, symmetric)
            done[symmetric, biases] = mine, ref
        return done[symmetric, biases]

    def swapped() -> None:
        mine, ref = pair(True)
        for name, want in decoder_linears(ref).items():
            got = mine.get_submodule(name)
            if not isinstance(got, QuantLinear):
                raise AssertionError(
                    f"{name} is still a {type(got).__name__}\nhint: replace the module in its parent, "
                    f"setattr(parent, child, QuantLinear(...)) (parent = model.get_submodule(...)): giving the old "
                    f"layer new attributes leaves its float weight and its forward in place")
            if (got.out_features, got.in_features) == (want.in_features, want.out_features) != \
                    (want.out_features, want.in_features):
                raise AssertionError(
                    f"{name}: a QuantLinear of [{got.out_features}, {got.in_features}], but the layer is "
                    f"[{want.out_features}, {want.in_features}] ([N, K], nn.Linear's layout)\nhint: quantize the "
                    f"weight as stored, [N, K], not transposed: its groups run along K, the inputs a matmul sums over")
            if (got.out_features, got.in_features) != (want.out_features, want.in_features):
                raise AssertionError(f"{name}: a QuantLinear of [{got.out_features}, {got.in_features}], expected "
                                     f"[{want.out_features}, {want.in_features}]")

    def kept() -> None:
        mine, _ = pair(True)
        base = _float_model()
        for name, module in (("lm_head", mine.lm_head), ("model.embed_tokens", mine.model.embed_tokens)):
            original = base.get_submodule(name)
            if type(module) is not type(original) or not torch.equal(module.weight, original.weight):
                raise AssertionError(
                    f"{name} was changed (it is a {type(module).__name__})\nhint: quantize the decoder layers' "
                    f"projections only (model.model.layers): lm_head writes the logits, whose error no later layer "
                    f"averages away, and the embedding is a lookup that reads one row per token, so quantizing it "
                    f"saves no bandwidth")

    def same_bytes(symmetric: bool) -> Check:
        def run() -> None:
            mine, ref = pair(symmetric)
            for name, want in decoder_linears(ref).items():
                got = mine.get_submodule(name)
                if got.group_size != want.group_size:
                    raise AssertionError(
                        f"{name} (K = {want.in_features}): group {got.group_size}, expected {want.group_size}\nhint: "
                        f"group_size={128} does not divide every K: take each layer's group from group_for(name, K, "
                        f"group_size), which falls back to the largest power of two that divides K")
                for buf in ("qweight", "scales", "zeros"):
                    a, b = getattr(got, buf), getattr(want, buf)
                    if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                        raise AssertionError(f"{name}.{buf} differs from minifer's\nhint: quantize "
                                             f"linear.weight (float32, [N, K]) with the quantize you were given, at "
                                             f"the layer's group, symmetric as asked")
        return run

    def bias() -> None:
        mine, ref = pair(True, biases=True)
        for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.down_proj"):
            got, want = mine.get_submodule(name).bias, ref.get_submodule(name).bias
            if got is None or not torch.equal(got, want):
                raise AssertionError(f"{name}: the layer's bias is {'lost' if got is None else 'changed'}\nhint: "
                                     f"QuantLinear(qw, bias, kernel): pass the float layer's bias along (None when it "
                                     f"has none); only the weight is quantized")

    def kernel() -> None:
        mine, _ = pair(True)
        wrong = [n for n, m in decoder_linears(mine).items() if getattr(m, "kernel", None) is not _marked_kernel]
        if wrong:
            raise AssertionError(f"{wrong[0]} (and {len(wrong) - 1} more) does not multiply through the kernel "
                                 f"passed in\nhint: QuantLinear(qw, bias, kernel): the engine hands its kernel (or "
                                 f"yours) to the load step")

    def resident() -> None:
        mine, ref = pair(True)
        got, want = _model_bytes(mine), _model_bytes(ref)
        extra = sorted(set(got) - set(want))
        if sum(got.values()) > sum(want.values()):
            raise AssertionError(
                f"the model holds {sum(got.values()) / 2**20:.2f} MiB of tensors, minifer's int4 model "
                f"{sum(want.values()) / 2**20:.2f} MiB: the float weights are still resident"
                + (f" ({', '.join(extra[:2])}{', ...' if len(extra) > 2 else ''})" if extra else "")
                + "\nhint: the QuantLinear keeps the codes, scales and zero points, and the bias; give it nothing "
                  "else, and keep no reference to the float layer: it is freed once swapped out")

    def logits() -> None:
        mine, ref = pair(True)
        if not torch.allclose(_logits(mine), _logits(ref), rtol=1e-5, atol=1e-5):
            raise AssertionError("the quantized model's logits differ from minifer's int4 model's")

    checks: list[Check] = [
        ("every decoder projection becomes a QuantLinear of its layer's shape [N, K]", swapped),
        ("lm_head and embed_tokens stay float32, untouched", kept),
        ("the bytes are minifer's quantize_model(model, 'int4'), g128 symmetric (down_proj, K = 704: g64)",
         same_bytes(True)),
        ("the same, asymmetric (zero points)", same_bytes(False)),
        ("biases are carried over (a copy with biases on layer 0)", bias),
        ("each QuantLinear multiplies through the kernel it was given", kernel),
        ("the float weights are gone: the model holds as many bytes as minifer's int4 model", resident),
        ("the logits are minifer's int4 model's", logits),
    ]
    run_checks("quantize_linears", checks)
