"""The continuous-batching engine over the paged KV cache: same tokens as solo and static runs, under
preemption, with prefix caching, with aborts and bad requests mid-stream, and without leaking blocks."""

from __future__ import annotations

import random

import pytest
import torch

from minifer import LLM, SamplingParams
from minifer.attention.backends.paged import PagedAttentionMetadata, PagedKVCache

pytestmark = pytest.mark.core  # the fast tier (tests/README.md)

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def static_llm():
    return LLM("tinystories-target", batching="static", max_num_seqs=32)


def continuous(**kw) -> LLM:
    return LLM("tinystories-target", batching="continuous", **kw)


def mixed_prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [0] + [rng.randrange(1, 2048) for _ in range(rng.randint(1, 40))]} for _ in range(n)]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("use_null_block", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 5, 4), (2, 17, 16), (4, 33, 8)])
def test_paged_reference_equals_dense_attention(shape, use_null_block):
    batch, max_ctx, block_size = shape
    hq, hkv, d = 6, 2, 8
    gen = torch.Generator().manual_seed(sum(shape))
    ctx = [int(torch.randint(1, max_ctx + 1, (1,), generator=gen)) for _ in range(batch)]
    qlen = [max(1, int(torch.randint(1, c + 1, (1,), generator=gen))) for c in ctx]
    nblocks = sum(-(-c // block_size) for c in ctx) + 3
    perm = torch.randperm(nblocks, generator=gen).tolist()
    tables, used = [], 0
    for c in ctx:
        n = -(-c // block_size)
        tables.append(perm[used : used + n])
        used += n
    cache = PagedKVCache(1, nblocks, block_size, hkv, d, torch.float32, "cpu")
    cache.k[:, :-1].fill_(float("nan"))  # poisoned: unwritten slots must never be read
    cache.v[:, :-1].fill_(float("nan"))
    if not use_null_block:  # then even the null block is poisoned, and masked keys must be zeroed
        cache.k[:, -1].fill_(float("nan"))
        cache.v[:, -1].fill_(float("nan"))
    q = [torch.randn(c, hq, d, generator=gen) for c in ctx]
    k = [torch.randn(c, hkv, d, generator=gen) for c in ctx]
    v = [torch.randn(c, hkv, d, generator=gen) for c in ctx]
    for b, c in enumerate(ctx):  # the cached context
        for p in range(c - qlen[b]):
            slot = tables[b][p // block_size] * block_size + p % block_size
            cache.k[0].view(-1, hkv, d)[slot], cache.v[0].view(-1, hkv, d)[slot] = k[b][p], v[b][p]
    cache.meta = PagedAttentionMetadata.build(tables, ctx, qlen, block_size, torch.device("cpu"),
                                              null_slot=cache.null_slot if use_null_block else None)
    new = lambda xs: torch.cat([x[c - ql :] for x, c, ql in zip(xs, ctx, qlen)])  # noqa: E731
    out = cache.attend(0, new(q), new(k), new(v))
    ref = []
    for b, c in enumerate(ctx):
        r = torch.nn.functional.scaled_dot_product_attention(
            q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1), is_causal=True, enable_gqa=True)
        ref.append(r.transpose(0, 1)[c - qlen[b] :])
    ref = torch.cat(ref)
    assert torch.isfinite(out).all()
    assert (out - ref).norm() / ref.norm() < 1e-5


def test_continuous_batch_of_32_matches_solo_and_static(static_llm):
    prompts = mixed_prompts(32)
    params = [SamplingParams(temperature=0, max_tokens=random.Random(i).randint(4, 24), ignore_eos=True)
              for i in range(32)]
    llm = continuous(max_num_seqs=32)
    batched = tokens(llm.generate(prompts, params, use_tqdm=False))
    static = tokens(static_llm.generate(prompts, params, use_tqdm=False))
    solo_idx = [0, 7, 19, 31]
    solo = [tokens(llm.generate([prompts[i]], params[i], use_tqdm=False))[0] for i in solo_idx]
    assert batched == static
    assert [batched[i] for i in solo_idx] == solo
    assert all(len(t) == p.max_tokens for t, p in zip(batched, params))


def test_quarter_budget_preempts_and_still_matches():
    prompts = mixed_prompts(12, seed=1)
    roomy = continuous(max_num_seqs=12)
    want = tokens(roomy.generate(prompts, GREEDY, use_tqdm=False))
    need = sum(-(-(len(p["prompt_token_ids"]) + 24) // 4) for p in prompts)
    tight = continuous(max_num_seqs=12, block_size=4, num_kv_blocks=need // 4, max_num_batched_tokens=64)
    got = tokens(tight.generate(prompts, GREEDY, use_tqdm=False))
    assert got == want
    stats = tight.stats()
    assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    tight.engine.kv_cache_manager.check_invariants()


def test_prefix_cache_hits_give_identical_output():
    system = {"prompt_token_ids": [0] + list(range(100, 164))}  # 65 tokens: 4 full blocks of 16
    prompts = [{"prompt_token_ids": system["prompt_token_ids"] + [300 + i, 400 + i]} for i in range(4)]
    cold = continuous(enable_prefix_caching=False)
    want = tokens(cold.generate(prompts, GREEDY, use_tqdm=False))
    warm = continuous(max_num_seqs=1)  # one at a time, so later requests find the prefix cached
    got = tokens(warm.generate(prompts, GREEDY, use_tqdm=False))
    assert got == want
    assert warm.stats()["prefix_cache_hit_rate"] > 0.5


def test_chunked_prefill_matches_whole_prefill():
    prompts = mixed_prompts(6, seed=3)
    whole = tokens(continuous(max_num_batched_tokens=4096).generate(prompts, GREEDY, use_tqdm=False))
    chunked = tokens(continuous(max_num_batched_tokens=7).generate(prompts, GREEDY, use_tqdm=False))
    assert chunked == whole


def test_online_abort_and_bad_requests_leave_others_unharmed(static_llm):
    llm = continuous(max_num_seqs=4)
    engine = llm.engine
    prompts = mixed_prompts(3, seed=5)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.add_request("doomed", mixed_prompts(1, seed=9)[0], GREEDY)
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 3:
            engine.abort_request("doomed")
            with pytest.raises(KeyError, match="nope"):
                engine.abort_request("nope")
            with pytest.raises(ValueError, match="max_model_len"):
                engine.add_request("long", {"prompt_token_ids": [1] * 5000}, GREEDY)
            with pytest.raises(ValueError, match="top_p"):
                engine.add_request("badp", "hi", SamplingParams(top_p=2.0))
            with pytest.raises(ValueError, match="already in use"):
                engine.add_request("r0", "hi", GREEDY)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        steps += 1
    assert set(finished) == {"r0", "r1", "r2"}
    assert [finished[f"r{i}"] for i in range(3)] == tokens(static_llm.generate(prompts, GREEDY, use_tqdm=False))
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_request_larger_than_cache_is_rejected_clearly():
    llm = continuous(num_kv_blocks=2, block_size=16)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([{"prompt_token_ids": [0] * 20}], SamplingParams(max_tokens=20), use_tqdm=False)


def test_per_request_timestamps_are_ordered_and_complete():
    import time

    llm = continuous()
    engine = llm.engine
    arrived = time.perf_counter() - 0.5  # queued half a second in front of the engine
    engine.add_request("early", "Once upon a time", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       arrival_time=arrived)
    engine.add_request("now", "Tom had a ball", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    for rid, n in (("early", 5), ("now", 3)):
        m = finished[rid].metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert len(m.token_times) == n and m.token_times == sorted(m.token_times)
        assert m.token_times[0] == m.first_token_time and m.token_times[-1] <= m.finished_time
    assert finished["early"].metrics.arrival_time == arrived
    assert finished["early"].metrics.first_token_time - arrived >= 0.5  # TTFT counts the wait before the engine
