"""int8 on the CPU: ``quantization="int8"`` is weight-only there as everywhere (the dequantize-then-matmul reference),
and ``quantization="w8a8"`` is the integer GEMM that also rounds each token's activations (``w8a8_linear``).

Every bound here comes from a quantization step, never from an agreement rate measured once: an activation rounded
per token is off by at most half its row's step (absmax / 254), a weight rounded per channel by half its channel's
step (absmax / 254). Quantized models are compared teacher-forced (each position sees the same prefix), never by
free-running greedy agreement, which diverges for good at the first near-tie."""

from __future__ import annotations

import copy

import pytest
import torch

import minifer
from minifer.eval import causal_forward, heldout_windows
from minifer.quantization.formats import dequantize, quant_linear_reference, quantize
from minifer.quantization.linear import (
    QuantLinear,
    decoder_linears,
    quantize_per_token,
    w8a8_kernel,
    w8a8_linear,
)
from minifer.quantization.model import check_quantization, quantize_model

FLOAT_TOL = 1e-4  # float32 sums in another order: a few ulps of logits of magnitude ~10


def w8a8_bound(x: torch.Tensor, qw) -> torch.Tensor:
    """``|w8a8(x) - reference(x)|`` per output, ``[..., N]``: each activation is off by at most half its row's
    step, so output ``n`` by at most ``step / 2 * sum_k |W[n, k]|`` (the dequantized weight), plus float slack."""
    step = quantize_per_token(x)[1].view(*x.shape[:-1], 1)
    return step / 2 * dequantize(qw).abs().sum(1) * 1.001 + 1e-5


def test_w8a8_matches_the_reference_within_half_an_activation_step():
    torch.manual_seed(0)
    w, x, bias = torch.randn(96, 64) * 0.05, torch.randn(3, 5, 64), torch.randn(96)
    qw = quantize(w, "int8")
    ref, got = quant_linear_reference(x, qw, bias), w8a8_linear(x, qw, bias)
    assert got.shape == ref.shape == (3, 5, 96) and got.dtype == x.dtype
    assert ((got - ref).abs() <= w8a8_bound(x, qw)).all()
    # and it is exactly "round the activations, then the weight-only reference", to float32's rounding
    codes, scale = quantize_per_token(x)
    rounded = (codes * scale).view_as(x)
    assert torch.allclose(got, quant_linear_reference(rounded, qw, bias), atol=1e-5)
    assert not torch.allclose(got, ref, atol=1e-4)  # the activations' rounding is there to see


def test_w8a8_over_a_weight_kernel_is_the_integer_gemm():
    """The path off the CPU (the rounded activations through a weight-only kernel, here the reference standing in
    for Triton) computes what the integer GEMM computes."""
    torch.manual_seed(3)
    qw, x, bias = quantize(torch.randn(48, 128) * 0.1, "int8"), torch.randn(7, 128), torch.randn(48)
    assert w8a8_kernel(None) is w8a8_linear
    assert torch.allclose(w8a8_kernel(quant_linear_reference)(x, qw, bias), w8a8_linear(x, qw, bias), atol=1e-5)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_w8a8_refuses_other_weight_formats(fmt):
    qw, x = quantize(torch.randn(32, 128), fmt), torch.randn(4, 128)
    for kernel in (w8a8_linear, w8a8_kernel(quant_linear_reference)):
        with pytest.raises(ValueError, match=f"int8 weight codes, got a {fmt} weight"):
            kernel(x, qw)


def test_packed_codes_follow_an_in_place_change():
    torch.manual_seed(2)
    layer = QuantLinear(quantize(torch.randn(16, 32), "int8"), kernel=w8a8_linear)
    x = torch.randn(2, 32)
    before = layer(x)
    layer.qweight.neg_()  # the codes change: the cached [K, N] copy must not be reused
    assert torch.allclose(layer(x), -before, atol=1e-5)


def test_validation_names_every_choice():
    with pytest.raises(ValueError) as e:
        check_quantization("int8_w8a8")
    assert all(repr(m) in str(e.value) for m in ("int8", "int4", "fp8", "w8a8"))


def test_llm_kernels_on_the_cpu():
    """``int8`` multiplies through the weight-only reference, ``w8a8`` through the integer GEMM."""
    for method, want in (("int8", quant_linear_reference), ("w8a8", w8a8_linear)):
        llm = minifer.LLM("tinystories-draft", dtype="float32", device="cpu", quantization=method)
        layers = [m for m in llm.model.modules() if isinstance(m, QuantLinear)]
        assert layers and all(m.kernel is want and m.fmt == "int8" for m in layers), method
        assert llm.quantization_config.format == method


def test_a_saved_w8a8_model_reloads_as_w8a8(draft_llm, tmp_path):
    from minifer.model_loader.quantized import load_model, save_quantized

    model = copy.deepcopy(draft_llm.model)
    quantize_model(model, "w8a8")
    folder = save_quantized(model, tmp_path / "w8a8", source=draft_llm.model_path)
    again = load_model(folder, dtype=torch.float32, device=torch.device("cpu"))
    assert all(m.kernel is w8a8_linear for m in again.modules() if isinstance(m, QuantLinear))
    with pytest.raises(ValueError, match="holds a w8a8 checkpoint"):
        load_model(folder, "int8", dtype=torch.float32, device=torch.device("cpu"))


# --- the bundled target, teacher-forced ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def windows(target_llm):
    return heldout_windows(target_llm.tokenizer, max_len=128, max_tokens=1024)  # 8 windows of 128 tokens


@torch.no_grad()
def logits_of(model: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
    return model.compute_logits(causal_forward(model, windows)).float()


def with_weights(model: torch.nn.Module, change) -> torch.nn.Module:
    """A float copy of ``model`` whose decoder linears' weights are ``change(weight)``."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for lin in decoder_linears(out).values():
            lin.weight.copy_(change(lin.weight))
    return out


def test_llm_int8_on_the_cpu_is_the_dequantized_weight_model(target_llm, windows):
    """``LLM(quantization="int8")`` on the CPU computes the float model with the dequantized weights, to float32's
    rounding: the activations are not rounded (W8A8 would be off by ~0.3 in the logits here)."""
    int8 = minifer.LLM("tinystories-target", dtype="float32", device="cpu", quantization="int8")
    dequantized = with_weights(target_llm.model, lambda w: dequantize(quantize(w, "int8")))
    got, want = logits_of(int8.model, windows), logits_of(dequantized, windows)
    assert (got - want).abs().max() <= FLOAT_TOL * want.abs().max()


def test_w8a8_layers_on_the_target_stay_within_half_an_activation_step(target_llm, windows):
    """Every decoder linear of a W8A8 target, on the activations the model really feeds it, against the weight-only
    reference on the same input: within the bound of half a per-token step."""
    model = copy.deepcopy(target_llm.model)
    quantize_model(model, "w8a8")
    checked = []

    def check(layer, inputs, output):
        (x,) = inputs
        ref = quant_linear_reference(x, layer.quantized_weight, layer.bias)
        assert ((output - ref).abs() <= w8a8_bound(x, layer.quantized_weight)).all()
        checked.append(layer)

    hooks = [m.register_forward_hook(check) for m in model.modules() if isinstance(m, QuantLinear)]
    logits_of(model, windows)
    for h in hooks:
        h.remove()
    assert len(checked) == 4 * target_llm.model_config.num_hidden_layers


def test_int8_greedy_teacher_forced_within_the_weight_rounding_bound(target_llm, windows):
    """Against float32, the int8 target's logits move by no more than a bound derived from the weights' rounding,
    and so its greedy choice is the float model's wherever the float top-2 margin exceeds twice that bound.

    The bound: round-to-nearest leaves each weight off by at most half its channel's step, and behaves like uniform
    noise in that interval (the textbook model of rounding). Four float copies with such noise added (the same
    steps, fixed seeds) give the logit error that rounding of this size causes; the real rounding is one more draw
    of it, so it falls under the largest of four with probability 4/5 by exchangeability, and the factor 2 covers
    the draws' own spread (1.7x between the smallest and largest of these four)."""
    fp32 = logits_of(target_llm.model, windows)
    int8 = copy.deepcopy(target_llm.model)
    quantize_model(int8, "int8")
    error = (logits_of(int8, windows) - fp32).abs()

    def noisy(seed: int):
        g = torch.Generator().manual_seed(seed)
        return lambda w: w + (torch.rand(w.shape, generator=g) - 0.5) * quantize(w, "int8").scales[:, None]

    draws = [(logits_of(with_weights(target_llm.model, noisy(s)), windows) - fp32).abs().max() for s in range(4)]
    bound = 2 * max(draws)
    assert error.max() <= bound, f"int8 max logit error {error.max():.4f}, bound {bound:.4f} (draws {draws})"
    top2 = fp32.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * bound
    assert clear.float().mean() >= 0.5  # the statement covers most positions, not a vacuous few
    assert torch.equal(logits_of(int8, windows).argmax(-1)[clear], fp32.argmax(-1)[clear])
