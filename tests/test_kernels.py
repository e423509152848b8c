"""Triton paged-attention kernels vs the PyTorch reference (interpreter on CPU, native on a GPU), and
ahead-of-time compilation for sm_80 / sm_90 with a register/spill report."""

from __future__ import annotations

import pytest
import torch

from minifer.kernels import HAS_TRITON, TRITON_ERROR

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason=TRITON_ERROR)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(b, hq, hkv, d, block_size, max_ctx, dtype, seed):
    from minifer.layers.paged_attention import PagedAttentionMetadata

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
    (3, 6, 2, 8, 4, 13),       # GQA 3:1, partial last block
    (5, 12, 4, 24, 5, 40),     # head_dim and block size not powers of two
    (2, 8, 8, 32, 16, 100),    # multi-head (no grouping), several blocks
    (4, 14, 2, 64, 16, 33),    # GQA 7:1
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_matches_reference(b, hq, hkv, d, block_size, max_ctx, dtype):
    from minifer.kernels.paged_attention import paged_decode_attention
    from minifer.layers.paged_attention import paged_attention_reference

    q, kc, vc, tables, ctx, meta = _case(b, hq, hkv, d, block_size, max_ctx, dtype, seed=b * 100 + d)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    out.copy_(paged_decode_attention(q, kc, vc, tables, ctx))
    ref = paged_attention_reference(q.float(), kc.float(), vc.float(), meta)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.isfinite(out).all()
    assert ((out.float() - ref).norm() / ref.norm()).item() < tol


def test_paged_decode_rejects_bad_grouping():
    from minifer.kernels.paged_attention import paged_decode_attention

    q, kc, vc, tables, ctx, _ = _case(2, 6, 2, 8, 4, 9, torch.float32, 0)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_decode_attention(q[:, :5], kc, vc, tables, ctx)


@pytest.mark.parametrize("n,hkv,d", [(1, 1, 8), (7, 2, 32), (33, 3, 24)])
def test_store_kv_writes_exactly_its_slots(n, hkv, d):
    from minifer.kernels.paged_attention import store_kv

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
    from minifer.kernels.aot import compile_all, kernel_specs

    rows = compile_all()
    assert len(rows) == 2 * len(kernel_specs())
    assert {r["arch"] for r in rows} == {"sm_80", "sm_90"}
    for r in rows:
        assert r["cubin_bytes"] > 0 and r["registers"] > 0, r
        assert not r["spills"], f"{r['kernel']} spills registers on {r['arch']}: {r}"
        assert r["shared_bytes"] <= 100 * 1024, r


def test_cuda_graph_decode_path_gives_the_same_tokens():
    """The CUDA-graph decode path without a GPU: the static buffers, padding to a captured size (rows
    writing the scratch block), the decode-only metadata and the Triton kernels, replayed eagerly under the
    interpreter; greedy tokens must equal the reference path's. (Capture itself needs a GPU: gpu_check.sh.)"""
    from minifer import LLM, SamplingParams
    from minifer.engine.cuda_graph import DecodeGraphs, EagerReplay

    prompts = ["Once upon a time", "Tom had a big red", "The cat"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM("tinystories-target").generate(prompts, params, use_tqdm=False)]
    llm = LLM("tinystories-target", max_num_seqs=4, block_size=8)
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
