"""minifer_course.kv_memory (chapter 02): reservation arithmetic, the bookkeeping-only simulation against the
real engine (with preemption and prefix caching), paged attention against dense attention, and the demos."""

from __future__ import annotations

import math

import pytest
import torch

from minifer_course import kv_memory as kvm
from minifer.bench.workloads import BenchRequest, Workload


def _workload(pairs, vocab=2048, seed=0):
    import random

    rng = random.Random(seed)
    reqs = [BenchRequest(f"r{i}", [0] + [rng.randrange(1, vocab) for _ in range(p - 1)], o)
            for i, (p, o) in enumerate(pairs)]
    return Workload("test", reqs)


# --- pure arithmetic ----------------------------------------------------------------------------------


def test_blocks_and_waste():
    assert [kvm.blocks_for(n, 4) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]
    assert kvm.paged_slots([1, 4, 5], 4) == 4 + 4 + 8
    assert kvm.internal_waste([1, 4, 5], 4) == pytest.approx(1 - 10 / 16)
    assert kvm.internal_waste([3, 7], 1) == 0.0
    assert kvm.internal_waste([], 16) == 0.0
    with pytest.raises(ValueError):
        kvm.blocks_for(3, 0)


def test_block_size_tradeoff():
    rows = kvm.block_size_tradeoff([10, 20, 33], (1, 4, 16, 64), kv_bytes_per_token=100.0)
    assert [r["block_size"] for r in rows] == [1, 4, 16, 64]
    assert rows[0]["waste"] == 0.0 and rows[0]["entries_per_seq"] == pytest.approx(21)
    wastes = [r["waste"] for r in rows]
    assert wastes == sorted(wastes)  # bigger blocks, more empty slots (for these lengths)
    assert rows[1]["entries_per_seq"] == pytest.approx((3 + 5 + 9) / 3)
    assert rows[2]["waste"] == pytest.approx(1 - 63 / (16 + 32 + 48))
    assert rows[0]["table_bytes_per_kv_byte"] == pytest.approx(63 * 4 / (63 * 100.0))
    assert rows[3]["allocations_per_1k_tokens"] == pytest.approx(1000 / 64)
    with pytest.raises(ValueError):
        kvm.block_size_tradeoff([], (16,), kv_bytes_per_token=1.0)


def test_static_batch_usage_by_hand():
    # one batch of two rows: width = longest prompt 4 + largest output 3 = 7 slots per row, 3 passes
    # pass 0: 2 + 4 stored; pass 1: row 0 finished (1 token), row 1 holds 4 + 1; pass 2: 4 + 2
    u = kvm.static_batch_usage([2, 4], [1, 3], batch_size=2, max_model_len=10)
    assert u["steps"] == 3
    assert u["utilization"] == pytest.approx(17 / (3 * 2 * 7))
    assert u["utilization_max_len"] == pytest.approx(17 / (6 * 10))
    # two batches of one row: no padding, each row holds prompt + s of prompt + output
    u = kvm.static_batch_usage([2, 4], [1, 3], batch_size=1)
    assert u["steps"] == 4
    assert u["utilization"] == pytest.approx((2 + 4 + 5 + 6) / (1 * 3 + 3 * 7))
    with pytest.raises(ValueError):
        kvm.static_batch_usage([1], [1, 2], 1)


def test_generation_flops_counts():
    from minifer.config import ModelConfig
    from minifer.model_loader import load_config, resolve_model

    cfg: ModelConfig = load_config(resolve_model("tinystories-target", need_weights=False))
    c = kvm.generation_flops(cfg, prompt_len=16, new_tokens=10)
    assert c["with_cache_tokens"] == 25
    assert c["recompute_tokens"] == sum(range(16, 26))
    assert c["ratio"] > 5
    one = kvm.generation_flops(cfg, prompt_len=16, new_tokens=1)  # one token: a prefill either way
    assert one["ratio"] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        kvm.generation_flops(cfg, 0, 4)


def test_estimate_generation_seconds_linear():
    pts = [{"position": 0, "with_cache": 1.0, "recompute": 0.0}, {"position": 10, "with_cache": 1.0, "recompute": 10.0}]
    g = kvm.estimate_generation_seconds(pts, prompt_len=0, new_tokens=11)  # positions 0..9
    assert g["with_cache_s"] == pytest.approx(10.0)
    assert g["recompute_s"] == pytest.approx(sum(range(10)))
    g = kvm.estimate_generation_seconds(pts, prompt_len=10, new_tokens=3)  # 10, 11: extrapolated
    assert g["recompute_s"] == pytest.approx(10 + 11)


# --- the simulation ----------------------------------------------------------------------------------


def test_simulation_by_hand():
    # one request: 5 prompt tokens, 3 output tokens, blocks of 4
    recs = kvm.simulate_kv(_workload([(5, 3)]), max_model_len=64, block_size=4, num_kv_blocks=8,
                           enable_prefix_caching=False)
    assert [r.stored for r in recs] == [5, 6, 0]  # prefill, one decode, then the third token ends it
    assert [r.blocks_used for r in recs] == [2, 2, 0]
    assert recs[0].kv_utilization == pytest.approx(5 / 8)
    assert recs[0].reserved_exact == 8 and recs[0].lengths == (5,)
    u = kvm.summarize(recs, block_size=4, max_model_len=64)
    assert u.paged == pytest.approx(11 / 16) and u.contiguous_max == pytest.approx(11 / 128)
    assert u.contiguous_exact == pytest.approx(11 / 16) and u.peak_running == 1 and u.preemptions == 0
    assert u.fit_ratio == pytest.approx(8.0)


def test_simulation_fails_loudly():
    with pytest.raises(ValueError, match="no room"):
        kvm.simulate_kv(_workload([(8, 1)]), max_model_len=8)
    with pytest.raises(ValueError):
        kvm.summarize([], 16, 64)


def test_sharegpt_utilisation_ordering():
    w = kvm.sharegpt_workload(64, max_model_len=1024, seed=3)
    u = kvm.summarize(kvm.simulate_kv(w, max_model_len=1024, num_kv_blocks=16 * 64), 16, 1024)
    assert u.contiguous_max < u.contiguous_exact < u.paged <= 1.0
    assert u.paged > 0.95 and u.preemptions == 0
    static = kvm.static_batch_usage(w.input_lens, w.output_lens, 16)
    assert static["utilization"] < u.contiguous_exact


def test_scale_outputs():
    w = _workload([(5, 17), (3, 2)])
    s = kvm.scale_outputs(w, 2, 8)
    assert [r.max_tokens for r in s.requests] == [2, 1]
    assert [r.prompt_token_ids for r in s.requests] == [r.prompt_token_ids for r in w.requests]


@pytest.fixture(scope="module")
def draft():
    from minifer import LLM

    return LLM("tinystories-draft", dtype="float32", device="cpu")


@pytest.mark.parametrize("blocks,prefix", [(256, True), (14, True), (14, False)])
def test_simulation_equals_engine(draft, blocks, prefix):
    """Step for step, including preemption (14 blocks of 8 cannot hold every request at once) and the prefix
    cache serving preempted requests their own blocks back."""
    from minifer.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
    from minifer.core.sched.scheduler import SchedulerConfig

    w = _workload([(20, 30), (9, 12), (33, 5), (4, 40), (17, 17), (25, 9)])
    engine = LLMEngine(draft.model, draft.tokenizer, draft.make_sequence,
                       EngineConfig(CacheConfig(block_size=8, num_kv_blocks=blocks, enable_prefix_caching=prefix),
                                    SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32)))
    real = kvm.record_engine(engine, w)
    sim = kvm.simulate_kv(w, max_model_len=draft.max_model_len, **kvm.engine_settings(engine))
    assert sim == real
    if blocks == 14:
        assert real[-1].preemptions > 0


def test_record_engine_refuses_a_busy_engine(draft):
    from minifer.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine

    engine = LLMEngine(draft.model, draft.tokenizer, draft.make_sequence, EngineConfig(CacheConfig(num_kv_blocks=32)))
    engine.add_request("x", {"prompt_token_ids": [0, 5, 6]}, kvm.greedy_ignore_eos(3))
    with pytest.raises(ValueError, match="unfinished"):
        kvm.record_engine(engine, _workload([(4, 2)]))


def test_greedy_by_recompute_matches_engine(draft):
    prompt = [0, 419, 436, 259, 396]
    ours = kvm.greedy_by_recompute(draft.model, prompt, 12)
    out = draft.generate([{"prompt_token_ids": prompt}], kvm.greedy_ignore_eos(12), use_tqdm=False)[0]
    assert ours == out.outputs[0].token_ids


# --- attention -------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paged_vs_dense(seed):
    r = kvm.paged_vs_dense(seed, context_lens=(5, 1, 33, 16, 17), query_lens=(5, 1, 7, 1, 2), block_size=4,
                           num_heads=6, num_kv_heads=2, head_dim=8)
    assert r["max_abs_error"] < 1e-5 and not r["nan"]
    assert len(r["slot_mapping"]) == 5 + 1 + 7 + 1 + 2


def test_dense_causal_attention_is_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.repeat_interleave(2, 1).transpose(0, 1)[None],
        v.repeat_interleave(2, 1).transpose(0, 1)[None],
        attn_mask=torch.arange(5)[None, :] <= (2 + torch.arange(3))[:, None])[0].transpose(0, 1)
    assert torch.allclose(kvm.dense_causal_attention(q, k, v), ref, atol=1e-6)


def test_triton_vs_reference():
    from minifer.kernels import HAS_TRITON

    r = kvm.triton_vs_reference(seed=0, context_lens=(1, 9, 20), block_size=8)
    assert r.ran == HAS_TRITON
    if not HAS_TRITON:
        assert "skipped" in r.message and not r.ok
    else:
        assert r.ok, r


# --- demos ------------------------------------------------------------------------------------------


def test_block_table_demo():
    bm, lens = kvm.block_table_demo(block_size=4, num_blocks=24)
    bm.check_invariants()
    assert set(lens) == {"A", "C", "D", "E"} and not bm.has_seq("B")
    for name, n in lens.items():
        assert len(bm.block_table(name)) == math.ceil(n / 4)
    used = sum(len(bm.block_table(n)) for n in lens)
    assert bm.num_free_blocks == 24 - used


def test_prefix_sharing_demo():
    bm, lens, cached = kvm.prefix_sharing_demo(block_size=4, num_blocks=16, system_len=10)
    bm.check_invariants()
    assert cached == {"A": 0, "B": 8, "C": 8}
    a, b, c = (bm.block_table(n) for n in "ABC")
    assert a[:2] == b[:2] == c[:2] and len({a[2], b[2], c[2]}) == 3
    assert bm.block_pool.blocks[a[0]].ref_count == 3


def test_prefix_prompts():
    ps = kvm.prefix_prompts(5, 20, (3, 6), vocab_size=50, bos_token_id=0, seed=1)
    assert all(p[:20] == ps[0][:20] for p in ps) and ps[0][0] == 0
    assert all(23 <= len(p) <= 26 for p in ps) and all(0 < t < 50 for p in ps for t in p[1:])
    assert ps == kvm.prefix_prompts(5, 20, (3, 6), vocab_size=50, bos_token_id=0, seed=1)
    no_bos = kvm.prefix_prompts(2, 8, (1, 1), vocab_size=50, bos_token_id=None)
    assert len(no_bos[0]) == 9 and no_bos[0][:8] == no_bos[1][:8]


def test_measure_prefix_caching_counts(draft):
    r = kvm.measure_prefix_caching(draft, system_len=32, question_lens=(2, 5), num_requests=4, rounds=1, block_size=8)
    # 3 of 4 requests find the 4 system-prompt blocks; each prompt has 4 full blocks (34..37 tokens)
    assert r["hit_rate"] == pytest.approx(12 / 16) and r["hit_rate_off"] == 0.0
    assert r["prompt_tokens_computed_off"] == r["prompt_tokens"]
    assert r["prompt_tokens_computed_on"] == r["prompt_tokens"] - 3 * 32
    assert r["mean_ttft_on_s"] > 0 and r["mean_ttft_off_s"] > 0 and len(r["ttft_ratio_rounds"]) == 1


def test_random_prompts():
    ps = kvm.random_prompts(3, 12, vocab_size=50, bos_token_id=0, seed=2)
    assert [len(p) for p in ps] == [12] * 3 and all(p[0] == 0 for p in ps) and len({tuple(p) for p in ps}) == 3
    assert ps == kvm.random_prompts(3, 12, vocab_size=50, bos_token_id=0, seed=2)


def test_parallel_sampling_demo(draft):
    bm, lens, log = kvm.parallel_sampling_demo(draft, n=3, prompt_len=10, block_size=4, num_blocks=16, steps=2)
    bm.check_invariants()
    assert log == ["after step 1: running ['0_s'], waiting ['1_s', '2_s']",
                   "after step 2: running ['0_s', '1_s', '2_s'], waiting []"]
    tables = [bm.block_table(s) for s in ("0_s", "1_s", "2_s")]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2] and len({t[2] for t in tables}) == 3
    assert lens == {"0_s": 11, "1_s": 10, "2_s": 10}  # 10 prompt tokens + the outputs whose KV is written


def test_measure_parallel_sampling_counts(draft):
    rows = kvm.measure_parallel_sampling(draft, shapes=((40, 6),), n_values=(1, 3), num_prompts=2, block_size=8)
    one, three = rows
    assert all(r["same_tokens"] for r in rows)  # sharing changes where KV lives, not the sampled tokens
    assert one["memory_saving"] == 0 and one["peak_blocks_shared"] == one["peak_blocks_unshared"] == 2 * 6
    assert one["prompt_tokens_computed_shared"] == one["prompt_tokens_computed_unshared"] == 80
    # n=3: each of the 4 siblings finds the prompt's 4 full blocks ((40 - 1) // 8) and computes 8 tokens
    assert three["prompt_tokens_computed_shared"] == 80 + 4 * (40 - 32)
    assert three["prompt_tokens_computed_unshared"] == three["prompt_tokens"] == 240
    assert three["peak_blocks_unshared"] == 6 * 6 and three["peak_blocks_shared"] == 6 * 6 - 4 * 4
    assert three["end_state_saving"] == pytest.approx(2 * 4 / (3 * 6))
    assert 0 < three["memory_saving"] < 1 and three["steps_shared"] == three["steps_unshared"] + 1


def test_beam_search_demo(draft):
    bm, lens, log = kvm.beam_search_demo(draft, beam_width=3, prompt="Once upon a time", block_size=4,
                                         num_blocks=24, steps=3)
    bm.check_invariants()
    assert len(log) == 3 and all(line.startswith(f"after step {i + 1}: ") for i, line in enumerate(log))
    assert log[0].count("(fork of beam1)") == 2 and log[0].endswith("blocks copied: 1 -> 2, 1 -> 3")
    # three beams of 5 prompt tokens + 2 written outputs: the prompt's full block 0 is held by all of them
    assert set(lens.values()) == {7} and len(lens) == 3
    with pytest.raises(ValueError, match="steps must be in"):
        kvm.beam_search_demo(draft, steps=12, max_tokens=12)
    tables = [bm.block_table(b) for b in lens]
    assert all(t[0] == 0 for t in tables) and bm.block_pool.blocks[0].ref_count == 3 and len({t[1] for t in tables}) == 3


def test_measure_beam_search_counts(draft):
    rows = kvm.measure_beam_search(draft, shapes=((40, 12),), widths=(1, 3), num_prompts=2, block_size=8)
    one, three = rows
    assert one["memory_saving"] == 0 and one["forks"] == one["block_copies"] == one["kv_tokens_copied"] == 0
    assert one["peak_blocks_shared"] == one["peak_blocks_unshared"] == 2 * 7  # (40 + 12) / 8 -> 7 per prompt
    assert one["kv_tokens_reordered"] == 2 * sum(range(40, 40 + 11))  # every step's cache, except the first's
    assert 0 < three["memory_saving"] < 1 and three["peak_blocks_shared"] < three["peak_blocks_unshared"] == 2 * 3 * 7
    assert 0 < three["block_copies"] <= three["forks"] and three["steps"] == 12
    assert three["kv_tokens_copied"] <= 7 * three["block_copies"] < three["kv_tokens_reordered"]
