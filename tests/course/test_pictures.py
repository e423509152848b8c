"""The pictures of the engine at work (``minifer_course.pictures``) are drawn from what the engine really did: each
drawn cell is a recorded share of a step, a recorded block or a recorded draft, and the recordings agree with the
engine's own counters and allocator. Greedy sampling of fixed lengths makes every count the same on every run."""

from __future__ import annotations

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from minifer_course import pictures  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def run(target_llm):
    return pictures.record_run(target_llm)


def gids(fig, prefix: str) -> list:
    """The artists of ``fig`` whose gid starts with ``prefix`` (each drawn cell or marker carries one)."""
    found = []
    for ax in fig.axes:
        found += [a for a in (*ax.patches, *ax.lines, *ax.collections) if (a.get_gid() or "").startswith(prefix)]
    return found


def test_the_recorded_steps_are_the_engines_steps(run):
    # what the scheduler's batches gave each step is what the engine ran (its own count, LLMEngine.step_tokens)
    assert [sum(s.num_tokens for s in r.scheduled) for r in run.steps] == run.step_tokens
    c = run.counts()
    assert c["preemptions"] == run.engine_stats["num_preemptions"] >= 1  # the small cache forces preemption
    assert c["finished"] == c["requests"] == len(pictures.TIMELINE_PROMPTS)
    assert {rid: len(ids) for rid, ids in run.outputs.items()} == {
        f"r{i}": n for i, n in enumerate(pictures.TIMELINE_MAX_TOKENS)}
    assert c["most_running"] <= run.max_num_seqs
    assert all(sum(s.num_tokens for s in r.scheduled) <= run.max_num_batched_tokens for r in run.steps)
    assert c["prefill_cells"] > len(pictures.TIMELINE_PROMPTS)  # chunked prompts and recomputations


def test_a_decode_cell_is_a_sampled_token_after_the_prompt(run):
    # each admission's prompt (its last chunk) samples one token, each decode one more: no other step samples (in this
    # run no request is preempted in the middle of its prompt)
    for rid in run.requests:
        admissions = sum(rid in r.admitted for r in run.steps)
        decodes = sum(s.request_id == rid for _, s in run.cells("decode"))
        assert decodes == len(run.outputs[rid]) - admissions, rid


def test_the_recording_is_deterministic(run, target_llm):
    again = pictures.record_run(target_llm)
    assert again.steps == run.steps and again.outputs == run.outputs and again.counts() == run.counts()


def test_the_timeline_draws_one_cell_per_recorded_share(run):
    fig = pictures.draw_timeline(run)
    c = run.counts()
    assert len(gids(fig, "prefill")) == c["prefill_cells"]
    assert len(gids(fig, "decode")) == c["decode_cells"] == c["decode_tokens"]  # a decode is one token
    assert len(gids(fig, "preempted")) == c["preemptions"]
    assert len(gids(fig, "finished")) == c["finished"]
    fig.savefig(__import__("io").BytesIO(), format="png")  # it renders


def test_a_request_life_passes_through_every_state(run):
    rid = pictures.preempted_request(run)
    lanes = pictures.life_lanes(run, rid)
    order = [lane for i, (_, lane) in enumerate(lanes) if i == 0 or lanes[i - 1][1] != lane]
    assert order[0] == "waiting" and order[-1] == "finished"
    assert ["prefill", "decode", "preempted", "prefill", "decode"] == [x for x in order if x != "waiting"][:5]
    preempted_at = next(step for step, what in run.life(rid) if what == "preempted")
    assert run.steps[preempted_at].blocks_held[rid] == 0  # recomputation frees every block
    fig = pictures.draw_request_life(run, rid)
    drawn = sum(len(col.get_offsets()) for col in gids(fig, "life:"))
    assert drawn == len(lanes)


def test_the_block_table_is_the_allocators(target_llm):
    engine, prompts = pictures.shared_prefix_engine(target_llm)
    snap = pictures.snapshot_blocks(engine, prompts=prompts)
    manager = engine.kv_cache_manager
    manager.check_invariants()
    pool = manager.block_pool
    assert snap.shared == [b.block_id for b in pool.blocks if b.ref_count > 1]
    prefix_tokens = len(target_llm.tokenizer(pictures.SHARED_PREFIX)["input_ids"])
    assert len(snap.shared) == prefix_tokens // snap.block_size  # every full block of the common prefix, once
    assert snap.counts()["cached"] == len(pool._evictable) >= 1  # the finished request's blocks, kept for reuse
    fig = pictures.draw_block_table(snap)
    assert len(gids(fig, "pool:")) == manager.num_blocks
    assert sorted(p.get_x() + 16 * p.get_y() for p in gids(fig, "pool:shared")) == pytest.approx(snap.shared, abs=0.5)
    assert len(gids(fig, "table:")) == sum(len(manager.block_table(rid)) for rid in snap.tables)
    assert len(gids(fig, "table:shared")) == len(snap.shared) * len(snap.tables) == 3 * len(pictures.SUFFIXES)
    steps = pictures.record_block_tables(target_llm)  # the same run, read after every step (a slider's frames)
    assert [s.step for s in steps] == list(range(len(steps)))
    assert (steps[-1].tables, steps[-1].ref_counts) == (snap.tables, snap.ref_counts)
    assert steps[0].shared == [] and "other" in steps[0].tables  # before the later requests found the prefix


def test_the_speculative_steps_are_the_verifiers(target_llm, draft_llm):
    run = pictures.record_speculation(target_llm, draft=draft_llm)
    c, stats = run.counts(), run.engine_stats
    assert (c["proposed"], c["accepted"]) == (stats["spec_num_proposed"], stats["spec_num_accepted"])
    emitted = [t for s in run.steps for t in s.emitted]
    assert run.output_token_ids[1 : 1 + len(emitted)] == emitted  # the prompt's step gave the first token
    assert all(s.emitted[: s.accepted] == s.proposed[: s.accepted] for s in run.steps)
    assert c["bonus_steps"] >= 1 and c["rejected_steps"] >= 1  # the default prompt shows both endings
    fig = pictures.draw_speculation(run, steps=len(run.steps))
    assert len(gids(fig, "spec:accepted")) == len(gids(fig, "emit:accepted")) == c["accepted"]
    assert len(gids(fig, "spec:rejected")) == len(gids(fig, "emit:correction")) == c["rejected_steps"]
    assert len(gids(fig, "emit:bonus")) == c["bonus_steps"]
    assert len(gids(fig, "spec:")) == c["proposed"]
