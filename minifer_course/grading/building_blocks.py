"""Graders of exercise 00 (chapter 00): ``rms_norm``, ``rope_inv_freq``, ``apply_rotary``, ``top_p``,
``decoder_layer``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from minifer_course.grading.base import Check, assert_close, call_unmodified, fmt_index, randn, run_checks, seeded

__all__ = ["check_rms_norm", "check_rope_inv_freq", "check_apply_rotary", "check_top_p", "check_decoder_layer"]


# --- chapter 00/01: RMSNorm ---------------------------------------------------------------------------


def _bf16_ulp(y: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 values (8 significant bits) in the binade of each element of float ``y``."""
    _, e = torch.frexp(y.double())
    return torch.ldexp(torch.ones_like(y, dtype=torch.float64), e - 8)


def _rms_norm_low_precision_problem(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                    eps: float) -> str | None:
    """What is wrong with ``got``, ``rms_norm(x, weight, eps)`` for bfloat16 ``x`` and ``weight`` (``None``:
    nothing). The required order: normalise in float32, cast back to bfloat16 (the one rounding of the
    normalised value), then multiply by ``weight`` (the product rounded once more). So each value must be
    within half a bfloat16 ulp of ``weight * b``, with ``b`` the normalised value rounded to bfloat16 (either
    neighbour when it lies within a few float32 ulps of a rounding boundary, where float32 details decide)."""
    x64 = x.double()
    n64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.double()
    delta = 2.0 ** -19  # about 32 float32 ulps: how far float32 ways of computing the normalised value differ
    g = got.detach().double()
    err = torch.full_like(g, float("inf"))
    for bump in (1 - delta, 1 + delta):
        b = (n64 * bump).float().to(torch.bfloat16).double()
        y = w * b  # exact: a product of two bfloat16 values fits in float64 (and float32)
        err = torch.minimum(err, (g - y).abs() / _bf16_ulp(y).clamp(min=2.0 ** -133))
    bad = ~(err <= 0.5)
    if not bool(bad.any()):
        return None
    want = weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    first = int(bad.flatten().nonzero()[0])
    head = (f"{int(bad.sum())} of {bad.numel()} values are more than half a bfloat16 ulp from weight * (x normalised "
            f"in float32, cast back to bfloat16); first at index {fmt_index(first, x.shape)}: got "
            f"{float(g.flatten()[first]):.6g}, expected {float(want.flatten()[first]):.6g}")
    n32 = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    if torch.equal(got, (weight * n32).to(x.dtype)):
        why = ("you multiplied by weight in float32, then cast: cast the normalised x back to x.dtype first, then "
               "multiply by weight (`weight * normed.to(x.dtype)`, as transformers does): two roundings, not one")
    else:
        why = ("compute the mean of squares, the rsqrt and the normalisation in float32 (x.float()), cast back "
               "with .to(x.dtype), then multiply by weight; bfloat16 arithmetic alone is off by several ulps")
    return f"{head}\nhint: {why}"


def check_rms_norm(fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> None:
    """Grade ``fn(x, weight, eps)`` against :func:`minifer.layers.layernorm.rms_norm`; in bfloat16, to half an ulp of
    the notebook's order of operations (normalise in float32, cast back, multiply by weight)."""
    from minifer.layers.layernorm import rms_norm as ref

    gen = seeded(0)
    hint = "rms_norm(x) = x / sqrt(mean(x**2 over the last dim) + eps) * weight"

    def case(x: torch.Tensor, weight: torch.Tensor, eps: float, atol: float = 1e-5, rtol: float = 1e-5,
             extra_hint: str = "") -> Check:
        def run() -> None:
            got = call_unmodified(fn, x, weight, eps)
            assert_close(got, ref(x, weight, eps), atol=atol, rtol=rtol, hint=extra_hint or hint)
        return run

    def bf16_case(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Check:
        def run() -> None:
            got = call_unmodified(fn, x, weight, eps)
            assert_close(got, ref(x, weight, eps), atol=0.5, rtol=0.5,  # shape, dtype, NaN; then the fine check
                         hint="compute in float32 (x.float()), cast back with .to(x.dtype), then multiply by weight")
            problem = _rms_norm_low_precision_problem(got, x, weight, eps)
            if problem:
                raise AssertionError(problem)
        return run

    tiny = randn(gen, 3, 16, scale=1e-3)
    zero_row = randn(gen, 3, 32)
    zero_row[1] = 0.0
    near_eps = randn(gen, 6, 40, scale=0.1) * torch.tensor([0.3, 0.6, 0.9, 1.2, 1.6, 2.5])[:, None]
    checks: list[Check] = [
        ("float32 [4, 64], random weight", case(randn(gen, 4, 64), randn(gen, 64), 1e-6)),
        ("3-D [2, 3, 48]: normalise the last dim only", case(randn(gen, 2, 3, 48, scale=3.0), randn(gen, 48), 1e-5,
                                                            extra_hint="reduce over dim=-1 with keepdim=True so "
                                                                       "it broadcasts back over x")),
        ("odd width [5, 7]", case(randn(gen, 5, 7), randn(gen, 7), 1e-6)),
        ("tiny inputs, eps=1e-2: eps goes inside the square root",
         case(tiny, torch.ones(16), 1e-2, extra_hint="add eps to the mean of squares, before the square root")),
        ("mean of squares near eps=1e-2: eps is added to it, not a floor",
         case(near_eps, randn(gen, 40), 1e-2, extra_hint="rsqrt(mean of squares + eps), not "
                                                         "rsqrt(clamp(mean of squares, min=eps)): the two differ "
                                                         "when the mean of squares is near eps")),
        ("an all-zero row gives zeros, not NaN",
         case(zero_row, randn(gen, 32), 1e-6, extra_hint="without eps, 0 / sqrt(0) is NaN")),
        ("bfloat16 [4, 256] in, bfloat16 out: float32 statistics, cast back, then times weight (half an ulp)",
         bf16_case(randn(gen, 4, 256, scale=4.0).bfloat16(), randn(gen, 256).bfloat16(), 1e-6)),
    ]
    run_checks("rms_norm", checks)


# --- chapter 00/01: RoPE ------------------------------------------------------------------------------


def check_rope_inv_freq(fn: Callable[[int, float], torch.Tensor]) -> None:
    """Grade ``fn(head_dim, theta)`` against :func:`minifer.layers.rotary_embedding.rope_inv_freq` (no scaling)."""
    from minifer.layers.rotary_embedding import rope_inv_freq as ref

    hint = ("one frequency per pair: theta ** (-2i / head_dim) for i = 0 .. head_dim/2 - 1, "
            "as a float32 tensor of shape [head_dim // 2]")

    def case(head_dim: int, theta: float) -> Check:
        def run() -> None:
            assert_close(fn(head_dim, theta), ref(head_dim, theta), atol=0.0, rtol=1e-5, hint=hint)
        return run

    checks: list[Check] = [
        ("head_dim 64, theta 10000 (Llama 2)", case(64, 10000)),
        ("head_dim 128, theta 500000 (Llama 3)", case(128, 500000.0)),
        ("head_dim 128, theta 1e6 (Qwen2/Qwen3)", case(128, 1e6)),
        ("head_dim 2: a single pair turning 1 radian per token", case(2, 10000.0)),
    ]
    run_checks("rope_inv_freq", checks)


def _cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
             ) -> tuple[torch.Tensor, torch.Tensor]:
    from minifer.layers.rotary_embedding import rope_inv_freq

    freqs = torch.outer(positions.float(), rope_inv_freq(head_dim, theta))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def check_apply_rotary(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """Grade ``fn(x, cos, sin)`` (x ``[tokens, heads, head_dim]``, cos/sin ``[tokens, head_dim]``) against
    :func:`minifer.layers.rotary_embedding.apply_rotary`."""
    from minifer.layers.rotary_embedding import apply_rotary as ref

    gen = seeded(1)
    hint = ("rotate-half layout: feature i pairs with feature i + head_dim/2; "
            "out = x * cos + cat(-x2, x1) * sin, with cos/sin broadcast over heads as cos[:, None, :]")

    def versus_ref(tokens: int, heads: int, head_dim: int, positions: list[int], theta: float = 10000.0,
                   dtype: torch.dtype = torch.float32, tol: float = 1e-5) -> Check:
        x = randn(gen, tokens, heads, head_dim).to(dtype)
        cos, sin = _cos_sin(torch.tensor(positions), head_dim, theta, dtype)

        def run() -> None:
            got = call_unmodified(fn, x, cos, sin)
            assert_close(got, ref(x, cos, sin), atol=tol, rtol=tol, hint=hint)
        return run

    def position_zero_is_identity() -> None:
        x = randn(gen, 3, 2, 16)
        cos, sin = _cos_sin(torch.zeros(3, dtype=torch.long), 16, 10000.0)
        assert_close(fn(x, cos, sin), x, atol=1e-6, rtol=1e-6, what="rotation at position 0",
                     hint="at position 0 every angle is 0 (cos = 1, sin = 0), so x must come back unchanged")

    def relative_positions() -> None:
        head_dim = 32
        q, k = randn(gen, 1, 1, head_dim), randn(gen, 1, 1, head_dim)
        pairs = [(5, 2), (8, 5), (53, 50), (103, 100)]  # the same distance m - n = 3 everywhere
        scores = []
        for m, n in pairs:
            cq, sq = _cos_sin(torch.tensor([m]), head_dim, 10000.0)
            ck, sk = _cos_sin(torch.tensor([n]), head_dim, 10000.0)
            scores.append((fn(q, cq, sq) * fn(k, ck, sk)).sum())
        got = torch.stack(scores)
        assert_close(got, scores[0].expand(len(pairs)).clone(), atol=1e-3, rtol=1e-4,
                     what="q·k at positions (5,2), (8,5), (53,50), (103,100)",
                     hint="rotating q by m·θ and k by n·θ must leave q·k depending on m - n only: "
                          "rotate each pair (x[i], x[i + head_dim/2]) by the same angle")

    checks: list[Check] = [
        ("float32, 5 tokens x 4 heads x 64, positions 0..4", versus_ref(5, 4, 64, [0, 1, 2, 3, 4])),
        ("decode positions [17, 300, 4095], 2 heads x 128, theta 5e5",
         versus_ref(3, 2, 128, [17, 300, 4095], theta=5e5, tol=1e-4)),
        ("head_dim 2: a single pair", versus_ref(4, 3, 2, [0, 1, 7, 9])),
        ("position 0 leaves x unchanged", position_zero_is_identity),
        ("q·k depends only on the distance m - n", relative_positions),
        ("bfloat16 in, bfloat16 out", versus_ref(6, 2, 64, [0, 5, 6, 7, 50, 51], dtype=torch.bfloat16, tol=2e-2)),
    ]
    run_checks("apply_rotary", checks)


# --- chapter 00/01: top-p (nucleus) sampling ------------------------------------------------------------


def _nucleus_p(logits_row: torch.Tensor, target: float, min_margin: float = 1e-4) -> float:
    """A ``top_p`` near ``target`` whose nucleus boundary is unambiguous: half-way between two consecutive
    cumulative probabilities, so float rounding (ascending vs descending sums) cannot change the answer."""
    probs = logits_row.double().softmax(-1).sort(descending=True).values
    cum = probs.cumsum(-1)
    k = int((cum < target).sum())  # the token that crosses target
    k = min(k, len(probs) - 1)
    while k > 0 and float(probs[k]) < 2 * min_margin:
        k -= 1
    return float(cum[k] - probs[k] / 2)


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def check_top_p(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """Grade ``fn(logits [B, V], top_p [B])`` against :func:`minifer.sample.sampler.apply_top_p`: dropped tokens
    must be ``-inf``, kept tokens must keep their logit, the nucleus must be exactly the reference's."""
    from minifer.sample.sampler import apply_top_p as ref

    gen = seeded(2)

    def case(logits: torch.Tensor, top_p: list[float]) -> Check:
        p = torch.tensor(top_p, dtype=torch.float32)

        def run() -> None:
            got = call_unmodified(fn, logits, p)
            want = ref(logits, p)
            if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
                assert_close(got, want, atol=0, rtol=0, hint="return the logits themselves (same shape and "
                                                             "dtype) with dropped tokens set to -inf, not a mask")
            got_kept, want_kept = got > float("-inf"), want > float("-inf")
            for row in range(want.shape[0]):
                if torch.equal(got_kept[row], want_kept[row]):
                    continue
                probs = logits[row].softmax(-1)
                n_got, n_want = int(got_kept[row].sum()), int(want_kept[row].sum())
                top = ", ".join(f"{v:.3f}" for v in probs.sort(descending=True).values[: min(n_want + 1, 6)].tolist())
                if n_got == 0:
                    why = "you kept no token at all: always keep the most likely one, however small p is"
                elif n_got < n_want:
                    why = ("you dropped a token of the nucleus: keep every token until the kept probability "
                           "reaches p, including the one that crosses p (and always the most likely one)")
                elif n_got > n_want:
                    why = "you kept a token outside the nucleus: stop as soon as the kept probability reaches p"
                else:
                    why = "the right number of tokens, but not the right ones: map the sorted order back " \
                          "to vocabulary positions (e.g. with scatter)"
                raise AssertionError(
                    f"row {row} (top_p={top_p[row]:.4g}): you kept {_tokens(n_got)}, expected {n_want}; the largest "
                    f"probabilities are [{top}, ...]\nhint: {why}")
            assert_close(got, want, atol=0, rtol=0, what="kept logits",
                         hint="kept tokens must keep their original logit (no softmax, no renormalising)")
        return run

    hand = torch.tensor([[0.2, 0.05, 0.5, 0.25]] * 2).log()  # sorted: 0.5, 0.25, 0.2, 0.05
    rows = randn(gen, 4, 50, scale=2.0)
    with_inf = randn(gen, 2, 20, scale=2.0)
    with_inf[:, 1::3] = float("-inf")  # as left by top-k
    big = randn(gen, 2, 4096, scale=3.0)
    peaked = randn(gen, 4, 30)
    peaked[1, 7] = 10.0  # one token holds ~99.9% of the mass
    peaked[3, 12] = 4.0
    checks: list[Check] = [
        ("4 rows x 50 tokens, a different top_p per row",
         case(rows, [_nucleus_p(rows[i], t) for i, t in enumerate([0.5, 0.9, 0.95, 0.3])])),
        ("the token that crosses p is kept: probs (.5, .25, .2, .05), p = 0.7 and 0.8", case(hand, [0.7, 0.8])),
        ("top_p = 1 keeps every token", case(randn(gen, 3, 10), [1.0, 1.0, 1.0])),
        ("a tiny top_p keeps only the most likely token", case(peaked, [1e-8, 0.5, 1e-4, 1e-8])),
        ("logits already -inf (after top-k) stay -inf",
         case(with_inf, [_nucleus_p(with_inf[0], 0.8), 1.0])),
        ("2 rows x 4096 tokens, p near 0.9 and 0.95",
         case(big, [_nucleus_p(big[0], 0.9), _nucleus_p(big[1], 0.95)])),
    ]
    run_checks("top_p", checks)


# --- chapter 00: the decoder layer ----------------------------------------------------------------------------


def _tiny_layer(qk_norm: bool, seed: int, model_cls: type | None = None):
    """A small random model (4 query heads on 2 KV heads, head_dim 8) of ``model_cls`` (a ``LlamaForCausalLM``
    subclass; minifer's when None), norms not all ones."""
    from minifer.config import ModelConfig
    from minifer.models.llama import LlamaForCausalLM

    cfg = ModelConfig("LlamaForCausalLM", "qwen3" if qk_norm else "llama", 50, 32, 48, 1, 4, 2, 8, 64, 1e-6, 10000.0,
                      None, False, False, False, qk_norm)
    torch.manual_seed(seed)  # nn.Linear draws its init from the global generator: kept local by fork_rng below
    model = (model_cls or LlamaForCausalLM)(cfg)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data = 1 + 0.1 * torch.randn_like(p)
    return model


def _layer_case(fn: Callable | None, qk_norm: bool, batch: int, seq_len: int, seed: int,
                model_cls: type | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``fn`` (the reference when None) on a fresh cache: the layer's output for random hidden states, and them."""
    from minifer.attention.layer import causal_backend

    with torch.random.fork_rng():
        model = _tiny_layer(qk_norm, seed, model_cls)
        x = torch.randn(batch * seq_len, model.config.hidden_size)
    layer = model.model.layers[0]
    attn, positions = causal_backend(model, batch, seq_len)
    cos, sin = model.model.rotary(positions, x.dtype)
    with torch.inference_mode():
        if fn is None:
            return layer(x, cos, sin, attn), x
        return call_unmodified(fn, layer, x, cos, sin, attn), x


def check_decoder_layer(fn: Callable[..., torch.Tensor]) -> None:
    """Grade ``fn(layer, x, cos, sin, attn)``, one decoder layer's forward over ``layer``'s modules (the signature of
    ``minifer.models.llama.DecoderLayer.forward``, whose ``self`` is ``layer``), against that forward."""
    hint = ("h = x + o_proj(attention(rope(q), rope(k), v)) with q, k, v split from qkv_proj(input_layernorm(x)) as "
            "[q_size, kv_size, kv_size] and viewed [tokens, heads, head_dim]; then h + down_proj(silu(gate) * up) "
            "with gate, up = gate_up_proj(post_attention_layernorm(h)).split(intermediate_size)")

    def versus_ref(qk_norm: bool, batch: int, seq_len: int, seed: int) -> Callable[[], None]:
        def run() -> None:
            want, x = _layer_case(None, qk_norm, batch, seq_len, seed)
            got, _ = _layer_case(fn, qk_norm, batch, seq_len, seed)
            if isinstance(got, torch.Tensor) and got.shape == want.shape:
                if torch.allclose(got + x, want, atol=1e-4, rtol=1e-4):
                    raise AssertionError("output: it is the layer's output minus its input\nhint: a decoder layer "
                                         "adds each block's output to the residual stream: x + attention(...), "
                                         "then h + mlp(...)")
            assert_close(got, want, atol=1e-4, rtol=1e-4, hint=hint)
        return run

    def uses_the_layers_modules() -> None:
        from minifer.layers.layernorm import RMSNorm
        from minifer.layers.rotary_embedding import apply_rotary
        from minifer.models.llama import Attention, LlamaForCausalLM

        calls: list[str] = []

        class CountedNorm(RMSNorm):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                calls.append("norm")
                return super().forward(x)

        class CountedAttention(Attention):
            @staticmethod
            def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
                calls.append("apply_rotary")
                return apply_rotary(x, cos, sin)

        counted = type("CountedLlama", (LlamaForCausalLM,), {"norm_cls": CountedNorm, "attention_cls": CountedAttention})
        _layer_case(fn, True, 1, 3, 5, counted)
        assert (calls.count("norm"), calls.count("apply_rotary")) == (4, 2), (
            f"called the layer's RMSNorm modules {calls.count('norm')} times and its attention's apply_rotary "
            f"{calls.count('apply_rotary')} times, expected 4 and 2 (input and post-attention norms, q_norm and "
            "k_norm, then RoPE on q and k)\nhint: normalise with the layer's modules (layer.input_layernorm(x), "
            "att.q_norm(q), ...) and rotate with att.apply_rotary(q, cos, sin): the model's own pieces (yours, in "
            "the capstone), not minifer's functions directly")

    checks: list[Check] = [
        ("one sequence of 5 tokens, Llama layout, 4 query heads on 2 KV heads", versus_ref(False, 1, 5, 0)),
        ("Qwen3 layout: q_norm and k_norm per head before RoPE", versus_ref(True, 1, 5, 1)),
        ("a batch of 3 sequences of 4 tokens, packed", versus_ref(False, 3, 4, 2)),
        ("a single token", versus_ref(True, 1, 1, 3)),
        ("normalises and rotates with the layer's own modules", uses_the_layers_modules),
    ]
    run_checks("decoder_layer", checks)
