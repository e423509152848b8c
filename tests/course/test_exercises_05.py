"""The grader of exercise 05's load step (``minifer_course.grading.quant_load.check_quantize_linears``): the
exercise's solution and minifer's own load step pass; each classic mistake fails with the hint that names it
(quantizing ``lm_head``, groups along the wrong axis, no group fallback, a lost bias, the float weight left
resident, the kernel not passed on, the module not swapped); the untouched stub is "not implemented yet".

The solution and the stub come from the exercise source (``test_workbench_quant.exercise_pieces``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch import nn

from minifer_course import workbench_quant
from minifer_course.grading.quant_load import check_quantize_linears
from minifer.quantization.formats import QuantizedWeight
from minifer.quantization.linear import QuantLinear
from minifer.quantization.model import group_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_workbench_quant import exercise_pieces  # noqa: E402


def _each_linear(model, skip_lm_head=True):
    """(parent, child, name, linear) of every nn.Linear, decoder layers first."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in found:
        if skip_lm_head and name == "lm_head":
            continue
        parent, _, child = name.rpartition(".")
        yield model.get_submodule(parent), child, name, linear


def _layer(quantize, name, linear, group_size, symmetric, kernel, *, transposed=False, bias=True, fallback=True):
    w = linear.weight.detach().float()
    w = w.t().contiguous() if transposed else w
    k = w.shape[1]
    group = group_for(name, k, group_size) if fallback else group_size if k % group_size == 0 else k
    packed, scales, zeros = quantize(w, group, symmetric)
    qw = QuantizedWeight("int4", packed, scales, zeros, group, tuple(w.shape))
    keep = linear.bias.detach().clone() if bias and linear.bias is not None and not transposed else None
    return QuantLinear(qw, keep, kernel)


def quantizes_lm_head(model, quantize, group_size=128, symmetric=True, kernel=None):
    for parent, child, name, linear in list(_each_linear(model, skip_lm_head=False)):
        setattr(parent, child, _layer(quantize, name, linear, group_size, symmetric, kernel))


def groups_along_n(model, quantize, group_size=128, symmetric=True, kernel=None):
    for parent, child, name, linear in list(_each_linear(model)):
        setattr(parent, child, _layer(quantize, name, linear, group_size, symmetric, kernel, transposed=True))


def no_group_fallback(model, quantize, group_size=128, symmetric=True, kernel=None):
    for parent, child, name, linear in list(_each_linear(model)):
        setattr(parent, child, _layer(quantize, name, linear, group_size, symmetric, kernel, fallback=False))


def forgets_the_bias(model, quantize, group_size=128, symmetric=True, kernel=None):
    for parent, child, name, linear in list(_each_linear(model)):
        setattr(parent, child, _layer(quantize, name, linear, group_size, symmetric, kernel, bias=False))


def keeps_the_float_weight(model, quantize, group_size=128, symmetric=True, kernel=None):
    for parent, child, name, linear in list(_each_linear(model)):
        layer = _layer(quantize, name, linear, group_size, symmetric, kernel)
        layer.weight = linear.weight  # "for later": now the model holds both
        setattr(parent, child, layer)


def ignores_the_kernel(model, quantize, group_size=128, symmetric=True, kernel=None):
    for parent, child, name, linear in list(_each_linear(model)):
        setattr(parent, child, _layer(quantize, name, linear, group_size, symmetric, None))


def adds_codes_to_the_float_layer(model, quantize, group_size=128, symmetric=True, kernel=None):
    for _, _, name, linear in list(_each_linear(model)):
        q = _layer(quantize, name, linear, group_size, symmetric, kernel)
        linear.register_buffer("qweight", q.qweight)


def returns_a_new_model(model, quantize, group_size=128, symmetric=True, kernel=None):
    import copy

    new = copy.deepcopy(model)
    workbench_quant.minifers_load_step(new, quantize, group_size, symmetric, kernel)
    return new


def test_the_exercise_solution_and_minifers_load_step_pass(capsys):
    check_quantize_linears(exercise_pieces("solution")["quantize_linears"])
    check_quantize_linears(workbench_quant.minifers_load_step)
    assert capsys.readouterr().out.count("quantize_linears: 8/8 checks passed") == 2


def test_the_untouched_stub_is_not_implemented_yet():
    with pytest.raises(AssertionError, match="not implemented yet"):
        check_quantize_linears(exercise_pieces("exercise")["quantize_linears"])


@pytest.mark.parametrize("wrong, match", [
    (quantizes_lm_head, r"lm_head was changed [\s\S]* quantize the decoder layers' projections only"),
    (groups_along_n, r"not transposed: its groups run along K"),
    (no_group_fallback, r"down_proj \(K = 704\): group 704, expected 64\nhint: [\s\S]*group_for"),
    (forgets_the_bias, r"bias is lost\nhint: QuantLinear\(qw, bias, kernel\): pass the float layer's bias"),
    (keeps_the_float_weight, r"float weights are still resident \(model.layers.0.mlp.down_proj.weight"),
    (ignores_the_kernel, r"does not multiply through the kernel passed in"),
    (adds_codes_to_the_float_layer, r"is still a Linear\nhint: replace the module in its parent"),
    (returns_a_new_model, r"changes the model in place"),
])
def test_classic_mistakes_are_rejected_with_their_hint(wrong, match):
    with pytest.raises(AssertionError, match=match):
        check_quantize_linears(wrong)
