"""Triton paged-attention kernels vs the PyTorch reference (interpreter on CPU, native on a GPU), and
ahead-of-time compilation for sm_80 / sm_90 with a register/spill report."""

from __future__ import annotations

import pytest
import torch

from minifer.kernels import HAS_TRITON, TRITON_ERROR

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason=TRITON_ERROR)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(b, hq, hkv, d, block_size, max_ctx, dtype, seed):
    from minifer.attention.backends.paged import PagedAttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    width = -(-max_ctx // block_size)
    nblocks = b * width + 3
    k_cache = torch.randn(nblocks, block_size, hkv, d, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(nblocks, block_size, hkv, d, generator=gen).to(DEVICE, dtype)
    ctx = torch.randint(1, max_ctx + 1, (b,), generator=gen)
    tables = torch.randperm(nblocks, generator=gen)[: b * width].view(b, width)
    q = torch.randn(b, hq, d, generator=gen).to(DEVICE, dtype)
    meta = PagedAttentionMetadata.build([t[: -(-c // block_size)].tolist() for t, c in zip(tables, ctx.tolist())],
                                        ctx.tolist(), [1] * b, block_size, torch.device(DEVICE))
    return q, k_cache, v_cache, tables.to(DEVICE, torch.int32), ctx.to(DEVICE, torch.int32), meta


@pytest.mark.parametrize("b,hq,hkv,d,block_size,max_ctx", [
    (1, 1, 1, 16, 16, 1),      # one token of context
    pytest.param(3, 6, 2, 8, 4, 13, marks=pytest.mark.core),  # GQA 3:1, partial last block; the fast tier's shape
    (5, 12, 4, 24, 5, 40),     # head_dim and block size not powers of two
    (2, 8, 8, 32, 16, 100),    # multi-head (no grouping), several blocks
    (4, 14, 2, 64, 16, 33),    # GQA 7:1
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_matches_reference(b, hq, hkv, d, block_size, max_ctx, dtype):
    from minifer.kernels.triton_attention import paged_decode_attention
    from minifer.attention.backends.paged import paged_attention_reference

    q, kc, vc, tables, ctx, meta = _case(b, hq, hkv, d, block_size, max_ctx, dtype, seed=b * 100 + d)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    out.copy_(paged_decode_attention(q, kc, vc, tables, ctx))
    ref = paged_attention_reference(q.float(), kc.float(), vc.float(), meta)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.isfinite(out).all()
    assert ((out.float() - ref).norm() / ref.norm()).item() < tol


@pytest.mark.parametrize("kv_cache_dtype,fp8_native", [("int8", False), ("fp8", False), ("fp8", True)])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("b,hq,hkv,d,block_size,max_ctx", [(3, 6, 2, 8, 4, 13), (5, 12, 4, 24, 5, 40)])
def test_paged_decode_reads_an_8bit_cache(kv_cache_dtype, static, fp8_native, b, hq, hkv, d, block_size, max_ctx,
                                          monkeypatch):
    """The kernel dequantizes 8-bit codes as it loads them (per token-and-head or static per-head scales;
    fp8 by the hardware conversion or by its bits); the oracle is the CPU path, which dequantizes as it gathers."""
    from minifer.kernels import triton_attention as pa
    from minifer.quantization.kv_cache import quantize_kv, static_scale
    from minifer.attention.backends.paged import paged_attention_reference

    if DEVICE == "cpu":
        monkeypatch.setattr(pa, "fp8_native", lambda device: fp8_native)
    elif fp8_native != pa.fp8_native(torch.device(DEVICE)):
        pytest.skip("this GPU decides the fp8 conversion itself")
    q, kc, vc, tables, ctx, meta = _case(b, hq, hkv, d, block_size, max_ctx, torch.float32, seed=b + d)
    caches, scales = [], []
    for c in (kc, vc):
        head = static_scale(c.abs().amax(dim=(0, 1, 3)) / 2, kv_cache_dtype) if static else None  # saturates some
        codes, s = quantize_kv(c.reshape(-1, hkv, d), kv_cache_dtype, head)
        caches.append(codes.view(c.shape))
        scales.append(s if static else s.view(c.shape[:-1]).contiguous())
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    out.copy_(pa.paged_decode_attention(q, *caches, tables, ctx, *scales, kv_cache_dtype))
    ref = paged_attention_reference(q, *caches, meta, *scales, kv_cache_dtype)
    assert torch.isfinite(out).all()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


def test_paged_decode_names_a_cache_that_does_not_match_its_scales():
    from minifer.kernels.triton_attention import paged_decode_attention

    q, kc, vc, tables, ctx, _ = _case(2, 6, 2, 8, 4, 9, torch.float32, 0)
    codes = kc.to(torch.int8)
    token = torch.ones(kc.shape[:-1], dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="takes no scales"):
        paged_decode_attention(q, kc, vc, tables, ctx, token, token)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' needs a cache of torch.uint8, got torch.int8"):
        paged_decode_attention(q, codes, codes, tables, ctx, token, token, "fp8")
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        paged_decode_attention(q, codes, codes, tables, ctx, token, None, "int8")
    with pytest.raises(ValueError, match=r"scales must be float16 \(.*\) \(per token and head\) or float32 \(2,\)"):
        paged_decode_attention(q, codes, codes, tables, ctx, token.float(), token.float(), "int8")


def test_paged_decode_rejects_bad_grouping():
    from minifer.kernels.triton_attention import paged_decode_attention

    q, kc, vc, tables, ctx, _ = _case(2, 6, 2, 8, 4, 9, torch.float32, 0)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_decode_attention(q[:, :5], kc, vc, tables, ctx)


@pytest.mark.parametrize("n,hkv,d", [(1, 1, 8), (7, 2, 32), (33, 3, 24)])
def test_store_kv_writes_exactly_its_slots(n, hkv, d):
    from minifer.kernels.triton_attention import store_kv

    gen = torch.Generator().manual_seed(n)
    kc = torch.full((10, 4, hkv, d), float("nan"), device=DEVICE)
    vc = kc.clone()
    k = torch.randn(n, hkv, d, generator=gen).to(DEVICE)
    v = torch.randn(n, hkv, d, generator=gen).to(DEVICE)
    slots = torch.randperm(40, generator=gen)[:n].to(DEVICE)
    store_kv(k, v, kc, vc, slots)
    assert torch.equal(kc.view(-1, hkv, d)[slots], k) and torch.equal(vc.view(-1, hkv, d)[slots], v)
    untouched = torch.ones(40, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.isnan(kc.view(-1, hkv, d)[untouched]).all()


def test_every_kernel_compiles_ahead_of_time_for_sm80_and_sm90():
    from minifer_course.experiments.aot import compile_all, kernel_specs

    rows = compile_all()
    assert len(rows) == 2 * len(kernel_specs())
    assert {r["arch"] for r in rows} == {"sm_80", "sm_90"}
    for r in rows:
        assert r["cubin_bytes"] > 0 and r["registers"] > 0, r
        assert not r["spills"], f"{r['kernel']} spills registers on {r['arch']}: {r}"
        assert r["shared_bytes"] <= 100 * 1024, r


class EagerReplay:
    """Stands in for a captured graph where there is no GPU (the tests): ``replay`` runs the same forward
    on the same static buffers, so everything around the graph — padding, the scratch block, the
    buffers' contents — is checked on a CPU with the Triton kernels under the interpreter."""

    def __init__(self, graphs, b: int) -> None:
        self.graphs, self.b = graphs, b
        graphs.outputs[b] = torch.empty(b, graphs.model.config.hidden_size,
                                        dtype=graphs.model.model.embed_tokens.weight.dtype)

    @torch.inference_mode()
    def replay(self) -> None:
        g, b = self.graphs, self.b
        g.cache.meta = g._meta(b)
        try:
            g.outputs[b].copy_(g.model(g.ids[:b], g.positions[:b], g.cache))
        finally:
            g.cache.meta = None


@pytest.mark.parametrize("kv_cache_dtype,kv_cache_scales", [("auto", "token"), ("int8", "token"), ("fp8", "token"),
                                                             ("int8", "head")])
def test_cuda_graph_decode_path_gives_the_same_tokens(kv_cache_dtype, kv_cache_scales):
    """The CUDA-graph decode path without a GPU: the static buffers, padding to a captured size (rows
    writing the scratch block), the decode-only metadata and the Triton kernels, replayed eagerly under the
    interpreter; greedy tokens must equal the reference path's, for a 16-bit cache and for 8-bit ones (which
    the decode kernel dequantizes as it loads). (Capture itself needs a GPU: gpu_check.sh.)"""
    from minifer import LLM, SamplingParams
    from minifer.worker.cuda_graph import DecodeGraphs

    prompts = ["Once upon a time", "Tom had a big red", "The cat"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = dict(kv_cache_dtype=kv_cache_dtype, kv_cache_scales=kv_cache_scales)
    want = [o.outputs[0].token_ids for o in LLM("tinystories-target", **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM("tinystories-target", max_num_seqs=4, block_size=8, **kw)
    runner = llm.engine.runner
    runner.cache.use_triton = True  # the kernels, as on a GPU (here: interpreted on CPU tensors)
    graphs = DecodeGraphs(runner.model, runner.cache, 4, -(-llm.max_model_len // 8))
    assert graphs.sizes == [1, 2, 4]
    graphs.graphs = {b: EagerReplay(graphs, b) for b in graphs.sizes}
    runner.graphs = graphs
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    null = runner.cache.null_slot // 8
    assert torch.all(runner.cache.k[:, null] == 0)  # the padded rows never touched the null block
