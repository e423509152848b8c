"""Chapter 06's benchmark (``minifer_course.stacking``): the configurations, the arithmetic that reads the gains,
the memory budget, and one small run on the bundled pair (correctness only: no timing is asserted)."""

from __future__ import annotations

import math

import pytest
import torch

from minifer_course import stacking as st


def test_configurations_are_static_plus_the_continuous_factorial():
    cfgs = st.configurations()
    assert cfgs[0] == frozenset() and len(cfgs) == 1 + 2**3 and len(set(cfgs)) == len(cfgs)
    assert all("continuous" in c for c in cfgs[1:])
    assert [st.label(c) for c in cfgs[:2]] == ["static", "CB"]
    assert st.label({"int8_kv", "continuous", "speculative"}) == "CB+spec+KV8"  # the course's order, not the set's
    with pytest.raises(ValueError, match="unknown lever.*'int4'"):
        st.label({"continuous", "int4"})


def _gains(factor: dict[str, float], interaction: float = 1.0) -> dict[frozenset[str], float]:
    """Gains over static of independent levers, the full stack multiplied by ``interaction``."""
    out = {}
    for c in st.configurations():
        g = math.prod(factor[x] for x in c)
        out[c] = g * (interaction if c == frozenset(st.LEVERS) else 1.0)
    return out


def test_independent_gains_stack_exactly():
    f = {"continuous": 3.0, "speculative": 1.5, "int8_weights": 1.2, "int8_kv": 1.1}
    a = st.lever_analysis(_gains(f))
    assert a["alone"] == pytest.approx(f)
    assert a["in_stack"] == pytest.approx(f)
    assert a["product"] == pytest.approx(a["stacked"]) == pytest.approx(3 * 1.5 * 1.2 * 1.1)
    assert a["overlap"] == pytest.approx(1.0)
    assert [p["add"] for p in a["path"]] == list(st.LEVERS)
    assert a["path"][-1]["cumulative"] == pytest.approx(a["stacked"])
    assert math.prod(p["step_gain"] for p in a["path"]) == pytest.approx(a["stacked"])
    for x, rows in a["contexts"].items():
        assert len(rows) == 4 and all(r["gain"] == pytest.approx(f[x]) for r in rows)


def test_overlapping_gains_are_caught():
    f = {"continuous": 3.0, "speculative": 1.5, "int8_weights": 1.2, "int8_kv": 1.1}
    a = st.lever_analysis(_gains(f, interaction=0.5))
    assert a["overlap"] == pytest.approx(2.0)  # the product of the alone gains overshoots twice
    assert a["alone"] == pytest.approx(f)  # the alone gains do not see it ...
    assert all(a["in_stack"][x] == pytest.approx(f[x] * 0.5) for x in st.LEVERS[1:])  # ... the last-added do
    with_all = [r for r in a["contexts"]["speculative"] if r["with"] == "CB+W8+KV8"]
    assert with_all[0]["gain"] == pytest.approx(1.5 * 0.5)


def test_analysis_names_a_missing_configuration():
    g = _gains({x: 2.0 for x in st.LEVERS})
    del g[frozenset({"continuous", "int8_kv"})]
    with pytest.raises(ValueError, match="missing CB\\+KV8"):
        st.lever_analysis(g)


def test_split_budget():
    b = st.split_budget(1000, 300, 64, 16)
    assert (b.kv_blocks, b.kv_bytes, b.static_rows) == (10, 640, None)
    b = st.split_budget(1000, 300, 64, 16, static_tokens_per_row=50)
    assert b.static_rows == 3  # 160 tokens of cache, 50 reserved per row
    b = st.split_budget(1000, 300, 64, 16, paged=True)  # the engine's scratch and null blocks come out of it too
    assert (b.kv_blocks, b.kv_bytes) == (8, 640)
    with pytest.raises(ValueError, match="not one block"):
        st.split_budget(300 + 2 * 64 + 63, 300, 64, 16, paged=True)
    with pytest.raises(ValueError, match="leaves -200 bytes for the KV cache after 1,200 bytes of weights"):
        st.split_budget(1000, 1200, 64, 16)
    with pytest.raises(ValueError, match="needs 200 tokens of cache but the budget holds 160"):
        st.split_budget(1000, 300, 64, 16, static_tokens_per_row=200)


def test_model_bytes_counts_shared_tensors_once():
    lin = torch.nn.Linear(8, 4)  # 32 + 4 float32
    assert st.model_bytes(lin) == 36 * 4
    tied = torch.nn.Module()
    tied.a, tied.b = lin, torch.nn.Linear(8, 4)
    tied.b.weight = lin.weight  # tied, as embeddings and lm_head can be
    assert st.model_bytes(tied) == (36 + 4) * 4


def test_agreement():
    ref = [[1, 2, 3, 4], [5, 6]]
    assert st.agreement(ref, ref) == {"identical": 1.0, "prefix": 1.0}
    a = st.agreement([[1, 2, 9, 4], [5, 6]], ref)
    assert a == {"identical": 0.5, "prefix": pytest.approx((2 / 4 + 1) / 2)}
    with pytest.raises(ValueError):
        st.agreement([[1]], ref)  # one list per request, or it is not the same workload


@pytest.fixture(scope="module")
def small_run():
    torch.manual_seed(0)
    return st.run(num_requests=6, output="exp:8:4:16", rounds=2, kv_memory=4 * 2**20)


def test_small_run_on_the_bundled_pair(small_run):
    rows = small_run["rows"]
    assert set(rows) == {st.label(c) for c in st.configurations()} | {"CB (A/A)"}
    for name, r in rows.items():
        assert r["same_tokens_every_round"], name
    # lossless levers: batching and speculation change how the tokens are computed, not which
    for name in ("static", "CB+spec", "CB (A/A)"):
        assert rows[name]["identical"] == 1.0, name
    b = {name: r["budget"] for name, r in rows.items()}
    assert len({x["memory"] for x in b.values()}) == 1  # one budget for all
    assert b["CB+W8"]["kv_blocks"] > 2 * b["CB"]["kv_blocks"]  # int8 weights leave most of fp32's to the cache
    assert b["CB+KV8"]["kv_blocks"] >= 1.9 * b["CB"]["kv_blocks"]  # 8-bit codes + a scale per (token, head)
    assert b["CB+spec"]["kv_blocks"] < b["CB"]["kv_blocks"]  # the draft costs its weights and its own cache
    assert b["static"]["static_rows"] >= 1
    a = small_run["analysis"]  # medians over the two rounds of each round's reading
    for key in ("product", "stacked", "overlap"):
        per_round = [st.lever_analysis({c: rows[st.label(c)]["round_gains"][r] for c in st.configurations()})[key]
                     for r in range(2)]
        assert a[key] == pytest.approx(sum(per_round) / 2)
    assert a["aa_band"][0] <= a["aa_band"][1] and len(a["aa_round_ratios"]) == 2
    assert all(r["tokens_generated"] == small_run["output_tokens"] for r in rows.values())  # nothing lost


def test_each_engine_really_has_its_levers(small_run):
    # build the engines again and look inside: each label must name what its engine runs, not just its budget
    w = st.Workload([[0, 5, 6]], [4])
    eng = st.Engines("tinystories-target", st.DRAFT, None, w, kv_memory=4 * 2**20)
    full = eng.llms["CB+spec+W8+KV8"]
    assert full.engine.speculator is not None and full.quantization_config is not None
    assert full.engine.kv_cache.kv_cache_dtype == "int8"
    plain = eng.llms["CB"]
    assert plain.engine.speculator is None and plain.quantization_config is None
    assert plain.engine.kv_cache.kv_cache_dtype == "auto"
    assert eng.llms["static"].engine is None
    # what the engines really allocated (target cache + the draft's) fits the budget beside their weights
    for name, llm in eng.llms.items():
        b = eng.budgets[name]
        if llm.engine is None:  # static: every row reserves the longest prompt plus the longest output
            per_token = b.block_bytes // eng.block_size
            assert b.static_rows * w.static_row_tokens * per_token <= eng.memory - b.weight_bytes, name
            continue
        caches = [llm.engine.kv_cache]
        if llm.engine.speculator is not None:
            caches.append(llm.engine.speculator.proposer.cache)
        allocated = sum(_tensor_bytes(c) for c in caches)
        assert allocated == b.kv_bytes == (b.kv_blocks + 2) * b.block_bytes, name  # + the scratch and null blocks
        assert b.weight_bytes + allocated <= eng.memory, name
    assert eng.budgets["CB+spec"].weight_bytes == st.model_bytes(plain.model) + st.model_bytes(full.draft_model)


def test_one_engine_at_a_time_frees_the_one_before():
    """The GPU's mode (a 16 GB GPU holds the weights and one engine's cache, not ten caches): each engine is built
    when asked for, with the budget of the eager mode, and the one before it is gone."""
    import weakref

    w = st.Workload([[0, 5, 6]], [4])
    lazy = st.Engines("tinystories-target", st.DRAFT, None, w, kv_memory=4 * 2**20, one_at_a_time=True)
    assert list(lazy.llms) == [st.label(c) for c in st.configurations()] + ["CB (A/A)"]
    first = weakref.ref(lazy.llms["CB+spec"])
    assert first().engine.kv_cache_manager.num_blocks == lazy.budgets["CB+spec"].kv_blocks
    second = lazy.llms["CB+W8+KV8"]
    assert first() is None and second is lazy.llms["CB+W8+KV8"]  # freed; the current one is kept while in use
    assert second.engine.kv_cache.kv_cache_dtype == "int8" and second.quantization_config.format == "w8a8"
    with pytest.raises(KeyError):
        lazy.llms["CB+W4"]
    assert lazy.llms["CB+W8+KV8"] is second  # an unknown name freed nothing


def _tensor_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for t in vars(cache).values() if isinstance(t, torch.Tensor))


def test_static_rows_reserve_the_longest_prompt_and_the_longest_output():
    w = st.Workload([[1] * 10, [1] * 3], [2, 20])
    assert w.longest == 23 and w.static_row_tokens == 30  # one batch pads to 10 and decodes to 20


def test_int8_dot_instructions_reads_the_cpu_flags():
    """The flag that decides whether W8A8's integer GEMM is fast is read from the CPU's own list, not guessed."""
    assert st.int8_dot_instructions("flags : fpu sse avx2 avx512f avx512_vnni") == (True, "avx512_vnni")
    assert st.int8_dot_instructions("flags : fpu sse avx2 avx_vnni amx_int8") == (True, "avx_vnni, amx_int8")
    has, what = st.int8_dot_instructions("flags : fpu sse avx2 fma")
    assert has is False and "VNNI" in what
