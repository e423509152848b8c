"""The exercise mechanism: generated notebooks in sync with their sources, solutions that pass their
checks, untouched exercises that fail them, and graders that reject the classic mistakes.

The graders in ``minifer.course.grading`` are the same functions the notebooks' check cells call; here they
also grade minifer's own implementations (which must pass) and deliberately wrong ones (which must fail).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch

from minifer.course.grading import building_blocks, paging
from minifer.bench.kv_memory import parallel_sampling_blocks
from minifer.layers.norm import rms_norm as ref_rms_norm
from minifer.layers.rotary import apply_rotary as ref_apply_rotary
from minifer.layers.rotary import rope_inv_freq as ref_rope_inv_freq
from minifer.sampling import apply_top_p as ref_apply_top_p

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import build_exercises as bx  # noqa: E402

EXERCISES = bx.discover()
EXERCISE_IDS = [e.name for e in EXERCISES]


# --- the generated files ----------------------------------------------------------------------------


def test_there_are_exercises():
    assert EXERCISES, "no sources in exercises/source/"


def test_generated_notebooks_are_up_to_date():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "build_exercises.py"), "--check"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, f"exercises/ or solutions/ are stale; run `make exercises`:\n{proc.stderr}"


@pytest.mark.parametrize("ex", EXERCISES, ids=EXERCISE_IDS)
def test_stored_notebooks_are_executed_only_where_they_should_be(ex):
    exercise, solution = nbformat.read(ex.exercise_path, 4), nbformat.read(ex.solution_path, 4)
    assert not bx.has_outputs(exercise), "the exercise notebook must be stored unexecuted"
    assert bx.execution_problems(solution) == []
    checks = [c for c in solution.cells if bx.is_check_cell(c)]
    assert checks and len(checks) == len([c for c in exercise.cells if bx.is_check_cell(c)])
    for cell in checks:  # the stored report is a passing one (nbval then compares it with a fresh run)
        assert _stdout(cell).rstrip().endswith("checks passed"), cell.source


# --- executing the notebooks (what nbval does in CI, plus the exercises) -----------------------------


def _execute(path: Path, allow_errors: bool) -> nbformat.NotebookNode:
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=bx.EXECUTE_TIMEOUT_S, kernel_name="python3", allow_errors=allow_errors,
                   resources={"metadata": {"path": str(path.parent)}}, record_timing=False).execute()
    return nb


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")


def _errors(cell) -> list:
    return [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]


@pytest.fixture
def my_engine(tmp_path_factory, monkeypatch, request):
    """The pieces the notebooks save (``minifer.course.workbench``) go to a temporary folder, one per kind of run
    (the solutions' and the untouched exercises' never mix), as they would to ``my_engine/`` beside the notebooks;
    never to a learner's own folder."""
    from minifer.course import workbench

    folder = tmp_path_factory.getbasetemp() / f"my_engine_{request.function.__name__}"
    monkeypatch.setenv(workbench.FOLDER_ENV, str(folder))


@pytest.mark.slow
@pytest.mark.parametrize("ex", EXERCISES, ids=EXERCISE_IDS)
def test_solutions_pass_their_checks(ex, my_engine):
    stored = nbformat.read(ex.solution_path, 4)
    fresh = _execute(ex.solution_path, allow_errors=False)  # raises CellExecutionError on any error
    for old, new in zip(stored.cells, fresh.cells):
        if bx.is_check_cell(new):
            assert _stdout(new) == _stdout(old), f"check output changed from the stored one:\n{new.source}"
            assert _stdout(new).rstrip().endswith("checks passed")


@pytest.mark.slow
@pytest.mark.parametrize("ex", EXERCISES, ids=EXERCISE_IDS)
def test_untouched_exercises_fail_their_checks(ex, my_engine):
    nb = _execute(ex.exercise_path, allow_errors=True)
    checks = [c for c in nb.cells if bx.is_check_cell(c)]
    assert checks
    for cell in checks:
        errors = _errors(cell)
        assert errors, f"this check passed on the untouched exercise, so it grades nothing:\n{cell.source}"
        assert errors[0]["ename"] == "AssertionError", (errors[0]["ename"], errors[0]["evalue"])
        assert "not implemented yet" in errors[0]["evalue"]
    for cell in nb.cells:
        if cell.cell_type == "code" and not bx.is_check_cell(cell):
            assert not _errors(cell), f"only check cells may fail in an untouched exercise:\n{cell.source}"


# --- the generator ------------------------------------------------------------------------------------

SOURCE = '''\
# a note for authors, not copied

# %% [markdown]
# # Title
#
# Some *prose*.

# %%
import torch

# %%
class Pool:
    def take(self, n: int) -> list[int]:
        """Docstring stays."""
        ### BEGIN SOLUTION
        return list(range(n))
        ### END SOLUTION

# %%
def f(x):
    ### BEGIN SOLUTION
    return x + 1
    ### END SOLUTION
    ### BEGIN STUB
    return ...  # fill in
    ### END STUB

# %% [markdown] exercise-only
# Hints for the learner.

# %% solution-only
print("only in the solution")

# %%
# NBVAL_CHECK_OUTPUT
print(f(1))
'''


def _render(text: str, variant: str) -> list[str]:
    return [t for t in (bx.render_cell(c, variant) for c in bx.parse_source(text)) if t is not None]


def test_solution_keeps_the_code_and_drops_markers_and_stubs():
    cells = _render(SOURCE, "solution")
    assert cells[0] == "# Title\n\nSome *prose*."
    assert "return list(range(n))" in cells[2] and "###" not in cells[2]
    assert cells[3] == "def f(x):\n    return x + 1"
    assert 'print("only in the solution")' in cells
    assert "Hints for the learner." not in cells


def test_exercise_replaces_solutions_with_stubs():
    cells = _render(SOURCE, "exercise")
    assert cells[2] == ('class Pool:\n    def take(self, n: int) -> list[int]:\n        """Docstring stays."""\n'
                        '        # YOUR CODE HERE\n        raise NotImplementedError("implement Pool.take")')
    assert cells[3] == "def f(x):\n    return ...  # fill in"  # an explicit stub replaces the default
    assert "Hints for the learner." in cells
    assert not any("only in the solution" in c for c in cells)
    assert not any("a note for authors" in c for c in cells)


def test_markdown_solution_blocks_vanish_from_the_exercise():
    text = "# %% [markdown]\n# Why?\n# ### BEGIN SOLUTION\n# Because.\n# ### END SOLUTION\n"
    assert _render(text, "exercise") == ["Why?"]
    assert _render(text, "solution") == ["Why?\nBecause."]


def test_cell_ids_are_stable_across_variants():
    cells = bx.parse_source(SOURCE)
    ex, sol = (bx.build_notebook(cells, v, "x.py") for v in bx.VARIANTS)
    assert [c.id for c in ex.cells] == ["cell-00", "cell-01", "cell-02", "cell-03", "cell-04", "cell-06"]
    assert [c.id for c in sol.cells] == ["cell-00", "cell-01", "cell-02", "cell-03", "cell-05", "cell-06"]
    assert bx.to_text(bx.build_notebook(cells, "exercise", "x.py")) == bx.to_text(ex)  # deterministic
    assert bx.is_check_cell(ex.cells[-1]) and not bx.is_check_cell(ex.cells[1])


@pytest.mark.parametrize("text, match", [
    ("# %%\ndef f():\n    ### BEGIN SOLUTION\n    pass\n", "never closed"),
    ("# %%\n### END SOLUTION\n", "without a matching BEGIN"),
    ("# %%\n### BEGIN SOLUTION\n### BEGIN STUB\n### END STUB\n### END SOLUTION\n", "inside an open"),
    ("# %%\n    ### BEGIN SOLUTION:\n", "malformed marker"),
    ("# %% [markdown]\nnot commented\n", "must start with"),
    ("# %% exercise_only\npass\n", "unexpected"),
    ("print('no cells')\n", "no cells"),
])
def test_malformed_sources_are_rejected_with_a_location(text, match):
    with pytest.raises(bx.SourceError, match=match):
        bx.parse_source(text, "src.py")


def test_check_mode_reports_every_kind_of_staleness(tmp_path, monkeypatch):
    src_dir, ex_dir, sol_dir = tmp_path / "exercises" / "source", tmp_path / "exercises", tmp_path / "solutions"
    src_dir.mkdir(parents=True)
    sol_dir.mkdir()
    for name, value in [("ROOT", tmp_path), ("SOURCE_DIR", src_dir), ("EXERCISE_DIR", ex_dir),
                        ("SOLUTION_DIR", sol_dir)]:
        monkeypatch.setattr(bx, name, value)
    (src_dir / "demo.py").write_text(SOURCE)
    [ex] = bx.discover()
    nbs = ex.notebooks()
    assert any("missing" in s for s in bx.check([ex], True))

    def fake_execute(nb):  # what execute() leaves: counts and outputs, no errors
        for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
            cell.execution_count = i + 1
        return nb

    bx.write_if_changed(ex.exercise_path, nbs["exercise"])
    bx.write_if_changed(ex.solution_path, fake_execute(nbs["solution"]))
    assert bx.check([ex], True) == []

    truncated = nbformat.read(ex.solution_path, 4)
    truncated.cells.pop()
    bx.write_if_changed(ex.solution_path, truncated)
    assert any("differs from its source" in s for s in bx.check([ex], True))
    bx.write_if_changed(ex.solution_path, fake_execute(ex.notebooks()["solution"]))

    unexecuted = ex.notebooks()["solution"]
    bx.write_if_changed(ex.solution_path, unexecuted)
    assert any("not executed" in s for s in bx.check([ex], True))
    bx.write_if_changed(ex.solution_path, fake_execute(ex.notebooks()["solution"]))

    ran = ex.notebooks()["exercise"]
    ran.cells[1].execution_count = 1
    bx.write_if_changed(ex.exercise_path, ran)
    assert any("has outputs" in s for s in bx.check([ex], True))
    bx.write_if_changed(ex.exercise_path, ex.notebooks()["exercise"])

    (src_dir / "demo.py").write_text(SOURCE.replace("Some *prose*.", "Other prose."))
    stale = bx.check([ex], True)
    assert len(stale) == 2 and all("differs from its source" in s for s in stale)
    (src_dir / "demo.py").write_text(SOURCE)

    (sol_dir / "renamed.ipynb").write_text("{}")
    assert any("renamed.ipynb has no source" in s for s in bx.check(bx.discover(), True))


# --- the graders: the reference passes, wrong versions fail ---------------------------------------


REFERENCES = [
    (building_blocks.check_rms_norm, ref_rms_norm, "rms_norm: 7/7 checks passed"),
    (building_blocks.check_rope_inv_freq, ref_rope_inv_freq, "rope_inv_freq: 4/4 checks passed"),
    (building_blocks.check_apply_rotary, ref_apply_rotary, "apply_rotary: 6/6 checks passed"),
    (building_blocks.check_top_p, ref_apply_top_p, "top_p: 6/6 checks passed"),
]


@pytest.mark.parametrize("grader, reference, summary", REFERENCES, ids=lambda v: getattr(v, "__name__", None))
def test_graders_pass_minifers_own_implementation(grader, reference, summary, capsys):
    rng = torch.random.get_rng_state()
    grader(reference)
    first = capsys.readouterr().out
    assert first.splitlines()[-1] == summary
    grader(reference)
    assert capsys.readouterr().out == first, "the report must be deterministic (nbval compares it)"
    assert torch.equal(torch.random.get_rng_state(), rng), "graders must not touch the global RNG"


def _rms_no_eps(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True))).to(x.dtype)


def _rms_eps_outside_sqrt(x, weight, eps):
    x32 = x.float()
    return weight * (x32 / (x32.pow(2).mean(-1, keepdim=True).sqrt() + eps)).to(x.dtype)


def _rms_global_mean(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean() + eps)).to(x.dtype)


def _rms_in_place(x, weight, eps):
    x32 = x.float()  # the same tensor as x when x is float32
    x32.mul_(torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))
    return weight * x32.to(x.dtype)


def _rms_no_cast_back(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _rms_all_bf16(x, weight, eps):  # the statistics in x's own dtype
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rms_weight_before_cast(x, weight, eps):  # one rounding instead of the notebook's two
    x32 = x.float()
    return (weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def _rms_clamp(x, weight, eps):  # eps as a floor of the mean of squares
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).clamp(min=eps))).to(x.dtype)


def _rms_divide(x, weight, eps):  # correct too: another float32 route to the normalised value
    x32 = x.float()
    return weight * (x32 / torch.sqrt((x32 * x32).sum(-1, keepdim=True) / x.shape[-1] + eps)).to(x.dtype)


def _inv_freq_no_factor_two(head_dim, theta):
    return 1.0 / theta ** (torch.arange(head_dim // 2).float() / head_dim)


def _inv_freq_float64(head_dim, theta):
    return 1.0 / theta ** (torch.arange(0, head_dim, 2).double() / head_dim)


def _rotary_interleaved(x, cos, sin):  # the original paper's (i, i+1) pairs: not what Llama/Qwen use
    rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _rotary_wrong_sign(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((x[..., half:], -x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _top_p(logits, top_p, *, strict=False, force_argmax=True, scatter=True, renormalise=False, in_place=False,
           one_p=False):
    """A descending-sort top-p with switches for the classic mistakes."""
    probs, order = logits.softmax(-1).sort(-1, descending=True)
    p = top_p[:1, None] if one_p else top_p[:, None]
    drop = probs.cumsum(-1) > p if strict else probs.cumsum(-1) - probs >= p
    if force_argmax:
        drop[:, 0] = False
    mask = torch.zeros_like(drop).scatter(-1, order, drop) if scatter else drop
    base = logits.log_softmax(-1) if renormalise else logits
    return base.masked_fill_(mask, float("-inf")) if in_place else base.masked_fill(mask, float("-inf"))


def _top_p_ascending_without_guard(logits, top_p):  # minifer's version minus "always keep the argmax"
    sorted_logits, order = logits.sort(dim=-1)
    drop = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p[:, None]
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


WRONG = [
    (building_blocks.check_rms_norm, _rms_no_eps, "eps goes inside"),
    (building_blocks.check_rms_norm, _rms_eps_outside_sqrt, "eps goes inside"),
    (building_blocks.check_rms_norm, _rms_global_mean, "check 1/7"),
    (building_blocks.check_rms_norm, _rms_in_place, "in place"),
    (building_blocks.check_rms_norm, _rms_no_cast_back, "dtype torch.float32, expected torch.bfloat16"),
    (building_blocks.check_rms_norm, _rms_all_bf16, "(?s)check 7/7.*half a bfloat16 ulp.*compute the mean of squares"),
    (building_blocks.check_rms_norm, _rms_weight_before_cast, "(?s)check 7/7.*you multiplied by weight in float32, then cast"),
    (building_blocks.check_rms_norm, _rms_clamp, "(?s)check 5/7.*not rsqrt\\(clamp\\(mean of squares, min=eps\\)\\)"),
    (building_blocks.check_rope_inv_freq, _inv_freq_no_factor_two, "check 1/4"),
    (building_blocks.check_rope_inv_freq, _inv_freq_float64, "dtype torch.float64"),
    (building_blocks.check_apply_rotary, _rotary_interleaved, "rotate-half layout"),
    (building_blocks.check_apply_rotary, _rotary_wrong_sign, "check 1/6"),
    (building_blocks.check_top_p, lambda lg, p: _top_p(lg, p, strict=True), "dropped a token of the nucleus"),
    (building_blocks.check_top_p, _top_p_ascending_without_guard, "kept no token at all"),
    (building_blocks.check_top_p, lambda lg, p: _top_p(lg, p, scatter=False), "not the right ones"),
    (building_blocks.check_top_p, lambda lg, p: _top_p(lg, p, renormalise=True), "original logit"),
    (building_blocks.check_top_p, lambda lg, p: _top_p(lg, p, in_place=True), "in place"),
    (building_blocks.check_top_p, lambda lg, p: _top_p(lg, p, one_p=True), "row 1"),
]


@pytest.mark.parametrize("grader, wrong, match", WRONG, ids=[m for _, _, m in WRONG])
def test_graders_reject_classic_mistakes(grader, wrong, match, capsys):
    with pytest.raises(AssertionError, match=match):
        grader(wrong)
    assert "  FAIL  " in capsys.readouterr().out


def test_rms_norm_bf16_check_is_half_an_ulp_on_any_inputs():
    """The bfloat16 check is exact enough to tell the orders of operations apart, yet passes correct
    float32 routes on any inputs (50 seeds, three shapes), not only on the grader's own."""
    wrong = {"all bf16": _rms_all_bf16, "weight before cast": _rms_weight_before_cast}
    caught = dict.fromkeys(wrong, 0)
    for seed in range(50):
        gen = torch.Generator().manual_seed(seed)
        for shape, scale in (((4, 256), 4.0), ((3, 4096), 1.0), ((8, 64), 0.01)):
            x = (torch.randn(*shape, generator=gen) * scale).bfloat16()
            w = torch.randn(shape[-1], generator=gen).bfloat16()
            for right in (ref_rms_norm, _rms_divide):
                assert building_blocks._rms_norm_low_precision_problem(right(x, w, 1e-6), x, w, 1e-6) is None, (seed, shape)
            for name, fn in wrong.items():
                caught[name] += building_blocks._rms_norm_low_precision_problem(fn(x, w, 1e-6), x, w, 1e-6) is not None
    assert caught == dict.fromkeys(wrong, 150), caught
    building_blocks.check_rms_norm(_rms_divide)


def test_graders_accept_the_alternative_top_p():
    building_blocks.check_top_p(_top_p)  # descending sort, exclusive cumsum: the solution's approach


def test_not_implemented_stub_gets_a_clear_message(capsys):
    def stub(*args):
        raise NotImplementedError("implement rms_norm")

    with pytest.raises(AssertionError, match="not implemented yet"):
        building_blocks.check_rms_norm(stub)


def test_an_assert_in_the_learners_code_is_not_a_failed_check():
    def asserts(x, weight, eps):  # `assert x.dim() == 2, "..."` in a notebook (pytest would rewrite an assert)
        if x.dim() != 2:
            raise AssertionError("only 2-D inputs")
        return ref_rms_norm(x, weight, eps)

    with pytest.raises(AssertionError, match=r"^rms_norm: check 2/7 \(3-D .*\): your function raised "
                                             r"AssertionError: only 2-D inputs$") as info:
        building_blocks.check_rms_norm(asserts)
    assert isinstance(info.value.__cause__, AssertionError)
    with pytest.raises(AssertionError, match="^rms_norm: check 1/7 failed"):  # the grader's own expectation
        building_blocks.check_rms_norm(_rms_global_mean)

    def bare_assert(table, positions, bs):
        raise AssertionError

    with pytest.raises(AssertionError, match=r"check 1/6 .*: your function raised AssertionError$"):
        paging.check_slot_mapping(bare_assert)


def test_a_crash_in_the_learners_code_names_the_check_and_keeps_the_cause():
    def crashes(x, cos, sin):
        return x * cos  # [T, H, D] * [T, D]: a broadcasting error

    with pytest.raises(AssertionError, match=r"check 1/6 .*RuntimeError") as info:
        building_blocks.check_apply_rotary(crashes)
    assert isinstance(info.value.__cause__, RuntimeError)


# --- chapter 02/03: paging and continuous batching ---------------------------------------------------------

from collections import OrderedDict, deque  # noqa: E402

import minifer.engine.block_manager as _bm  # noqa: E402
from minifer.engine.block_manager import BlockManager  # noqa: E402
from minifer.layers.paged_attention import PagedAttentionMetadata, paged_attention_reference  # noqa: E402
from minifer.layers.paged_attention import slot_mapping as ref_slot_mapping  # noqa: E402


def _ref_paged_attention(q, k_cache, v_cache, block_table, context_len):
    """minifer's batched reference, for one sequence (the exercise's signature)."""
    meta = PagedAttentionMetadata.build([block_table], [context_len], [q.shape[0]], k_cache.shape[1], q.device)
    return paged_attention_reference(q, k_cache, v_cache, meta)


class _BlockManagerAdapter(BlockManager):
    """minifer's BlockManager under the exercise's attribute names (the grader patches its chain_hash)."""

    def __init__(self, num_blocks, block_size, hash_fn=None):
        super().__init__(num_blocks, block_size)

    cache = property(lambda self: self._cache)
    tables = property(lambda self: {s: q.table for s, q in self._seqs.items()})
    ref_count = property(lambda self: [b.ref_count for b in self.blocks])


class _ForkingBlockManager(_BlockManagerAdapter):
    """minifer's fork and copy_on_write, with the exercise's given ``grow``."""

    def grow(self, seq_id, num_tokens):
        self.append_slots(seq_id, num_tokens)


REFERENCES_02_03 = [
    (paging.check_slot_mapping, ref_slot_mapping, "slot_mapping: 6/6 checks passed"),
    (paging.check_paged_attention, _ref_paged_attention, "paged_attention: 8/8 checks passed"),
    (paging.check_prefix_allocator, _BlockManagerAdapter, "prefix_allocator: 11/11 checks passed"),
    (paging.check_schedule_step, paging._schedule_with_minifer, "schedule_step: 11/11 checks passed"),
    (paging.check_parallel_sampling_blocks, parallel_sampling_blocks, "parallel_sampling_blocks: 8/8 checks passed"),
    (paging.check_forking_allocator, _ForkingBlockManager, "forking_allocator: 9/9 checks passed"),
]


@pytest.mark.parametrize("grader, reference, summary", REFERENCES_02_03,
                         ids=lambda v: getattr(v, "__name__", None))
def test_02_03_graders_pass_minifers_own_implementation(grader, reference, summary, capsys):
    test_graders_pass_minifers_own_implementation(grader, reference, summary, capsys)


def test_scheduler_scenarios_match_minifers_scheduler():
    """Every hand-written expected answer is what minifer's Scheduler does on the same state."""
    for label, kwargs, want, _ in paging.SCHEDULER_SCENARIOS:
        assert paging._schedule_with_minifer(**kwargs) == want, label


def test_the_paged_reference_is_dense_causal_attention():
    """The grader's answer key agrees with plain causal attention on the unpaged keys and values."""
    gen = torch.Generator().manual_seed(0)
    ctx, t, hq, hkv, d, bs = 13, 5, 6, 2, 8, 4
    table = [5, 0, 7, 2]
    k, v, q = (torch.randn(ctx, hkv, d, generator=gen), torch.randn(ctx, hkv, d, generator=gen),
               torch.randn(t, hq, d, generator=gen))
    k_cache, v_cache = torch.full((8, bs, hkv, d), float("nan")), torch.full((8, bs, hkv, d), float("nan"))
    slots = ref_slot_mapping(table, list(range(ctx)), bs)
    k_cache.view(-1, hkv, d)[slots], v_cache.view(-1, hkv, d)[slots] = k, v
    kk, vv = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("thd,shd->hts", q, kk) / d ** 0.5
    allowed = torch.arange(ctx)[None, :] <= (ctx - t + torch.arange(t))[:, None]
    dense = torch.einsum("hts,shd->thd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vv)
    torch.testing.assert_close(_ref_paged_attention(q, k_cache, v_cache, table, ctx), dense)


def test_the_allocator_grader_restores_chain_hash():
    original = _bm.chain_hash
    paging.check_prefix_allocator(_BlockManagerAdapter)
    assert _bm.chain_hash is original


# Classic mistakes.

def _slots_swapped(table, positions, bs):
    return [table[p % bs] * bs + p // bs for p in positions]


def _slots_block_not_scaled(table, positions, bs):
    return [table[p // bs] + p % bs for p in positions]


def _slots_no_table(table, positions, bs):
    return list(positions)


def _paged(q, k_cache, v_cache, table, ctx, *, offset=True, interleave=True, whole_blocks=False, scale=True):
    """A correct single-sequence paged attention with switches for the classic mistakes."""
    t, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    s = len(table) * bs if whole_blocks else ctx  # whole_blocks: read the last block's garbage tail too
    pos = torch.arange(s)
    slots = torch.tensor(table)[pos // bs] * bs + pos % bs
    k, v = k_cache.reshape(-1, hkv, d)[slots], v_cache.reshape(-1, hkv, d)[slots]
    rep = (lambda x: x.repeat_interleave(hq // hkv, 1)) if interleave else (lambda x: x.repeat(1, hq // hkv, 1))
    k, v = rep(k), rep(v)
    scores = torch.einsum("thd,shd->hts", q, k) / (d ** 0.5 if scale else 1.0)
    q_pos = (ctx - t if offset else 0) + torch.arange(t)
    allowed = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] < ctx)
    return torch.einsum("hts,shd->thd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


class _Allocator:
    """A correct prefix-caching allocator (the notebook's) with switches for the classic mistakes."""

    def __init__(self, num_blocks, block_size, hash_fn=_bm.chain_hash, *, verify=True, keep_last=True, evict=True,
                 lru=True, tail_first=True, unpark=True, uncache_evicted=True, stop_at_miss=True, park_cached=True):
        self.block_size, self.hash_fn = block_size, hash_fn
        self.verify, self.keep_last, self.evict, self.lru = verify, keep_last, evict, lru
        self.tail_first, self.unpark, self.uncache_evicted = tail_first, unpark, uncache_evicted
        self.stop_at_miss, self.park_cached = stop_at_miss, park_cached
        self.ref_count, self.block_hash = [0] * num_blocks, [None] * num_blocks
        self.block_tokens = [()] * num_blocks
        self.free_list, self.evictable = deque(range(num_blocks)), OrderedDict()
        self.cache, self.tables, self.seq_hashes = {}, {}, {}

    num_free_blocks = property(lambda self: len(self.free_list) + len(self.evictable))

    def blocks_needed(self, n):
        return -(-n // self.block_size)

    def full_block_hashes(self, tokens, start=0, parent=None):
        bs, out = self.block_size, []
        for i in range(start, len(tokens) // bs):
            parent = self.hash_fn(parent, tuple(tokens[i * bs:(i + 1) * bs]))
            out.append(parent)
        return out

    def can_allocate(self, tokens):
        hits = self.lookup_prefix(tokens)
        parked = sum(1 for b in hits if self.ref_count[b] == 0)
        return self.blocks_needed(len(tokens)) - len(hits) <= self.num_free_blocks - parked

    def register_computed(self, seq_id, tokens):
        table, hashes, bs = self.tables[seq_id], self.seq_hashes[seq_id], self.block_size
        for i, h in enumerate(self.full_block_hashes(tokens, len(hashes), hashes[-1] if hashes else None),
                              start=len(hashes)):
            hashes.append(h)
            b = table[i]
            if self.block_hash[b] is None and h not in self.cache:
                self.block_hash[b], self.block_tokens[b] = h, tuple(tokens[i * bs:(i + 1) * bs])
                self.cache[h] = b

    def lookup_prefix(self, tokens):
        bs, hits = self.block_size, []
        for i, h in enumerate(self.full_block_hashes(tokens)):
            b = self.cache.get(h)
            if b is None or (self.verify and self.block_tokens[b] != tuple(tokens[i * bs:(i + 1) * bs])):
                if self.stop_at_miss:
                    break
                continue
            hits.append(b)
        if self.keep_last and hits and len(hits) * bs >= len(tokens):
            hits.pop()
        return hits

    def take_free_block(self):
        if self.free_list:
            b = self.free_list.popleft()
        elif not self.evict:
            raise MemoryError("no free block")
        else:
            b, _ = self.evictable.popitem(last=not self.lru)
            if self.uncache_evicted:
                del self.cache[self.block_hash[b]]
                self.block_hash[b], self.block_tokens[b] = None, ()
        self.ref_count[b] = 1
        return b

    def allocate(self, seq_id, tokens):
        hits = self.lookup_prefix(tokens)
        table = []
        for b in hits:
            if self.ref_count[b] == 0 and self.unpark:
                del self.evictable[b]
            self.ref_count[b] += 1
            table.append(b)
        while len(table) < self.blocks_needed(len(tokens)):
            table.append(self.take_free_block())
        self.tables[seq_id] = table
        self.seq_hashes[seq_id] = [self.block_hash[b] for b in hits]
        return len(hits) * self.block_size

    def free(self, seq_id):
        table = self.tables.pop(seq_id)
        del self.seq_hashes[seq_id]
        for b in reversed(table) if self.tail_first else table:
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                if self.block_hash[b] is not None and self.park_cached:
                    self.evictable[b] = None
                else:
                    self.free_list.append(b)


class _ForkingAllocator(_Allocator):
    """The notebook's fork and copy_on_write, with switches for the classic mistakes."""

    def __init__(self, num_blocks, block_size, hash_fn=_bm.chain_hash, *, own_table=True, own_hashes=True,
                 add_refs=True, copy_private=False, drop_ref=True, replace=True):
        super().__init__(num_blocks, block_size, hash_fn)
        self.own_table, self.own_hashes, self.add_refs = own_table, own_hashes, add_refs
        self.copy_private, self.drop_ref, self.replace = copy_private, drop_ref, replace

    def grow(self, seq_id, num_tokens):
        table = self.tables[seq_id]
        while len(table) < self.blocks_needed(num_tokens):
            table.append(self.take_free_block())

    def fork(self, parent_id, child_id):
        table, hashes = self.tables[parent_id], self.seq_hashes[parent_id]
        self.tables[child_id] = list(table) if self.own_table else table
        self.seq_hashes[child_id] = list(hashes) if self.own_hashes else hashes
        for b in table:
            self.ref_count[b] += self.add_refs

    def copy_on_write(self, seq_id, position):
        table, index = self.tables[seq_id], position // self.block_size
        if index >= len(table) or (self.ref_count[table[index]] == 1 and not self.copy_private):
            return None
        shared, fresh = table[index], self.take_free_block()
        self.ref_count[shared] -= self.drop_ref
        if self.replace:
            table[index] = fresh
        return shared, fresh


def _forking_with(**mistake):
    return lambda num_blocks, block_size, hash_fn=_bm.chain_hash: _ForkingAllocator(num_blocks, block_size, hash_fn,
                                                                                    **mistake)


def _allocator_with(**mistake):
    return lambda num_blocks, block_size, hash_fn=_bm.chain_hash: _Allocator(num_blocks, block_size, hash_fn,
                                                                             **mistake)


def _schedule(running, waiting, free_blocks, block_size, max_num_seqs, token_budget, *, oldest_victim=False,
              admit_after_preemption=False, skip_ahead=False, chunk_blocks_only=False, no_chunking=False,
              keep_victim_blocks=False, in_place=False):
    """The notebook's schedule_step with switches for the classic mistakes."""
    running = running if in_place else list(running)
    scheduled, preempted = [], []
    budget, free = token_budget, free_blocks
    i = 0
    while i < len(running) and budget > 0:
        req = running[i]
        n = min(req.num_tokens - req.num_computed, budget)
        need = -(-(req.num_computed + n) // block_size) - req.num_blocks
        while need > free:
            victim = running.pop(0 if oldest_victim else -1)
            free += 0 if keep_victim_blocks else victim.num_blocks
            preempted.append(victim.name)
            if victim is req:
                break
        if preempted and preempted[-1] == req.name:
            break
        free -= max(need, 0)
        scheduled.append((req.name, n))
        budget -= n
        i += 1
    for req in waiting:
        if budget <= 0 or len(running) >= max_num_seqs or (preempted and not admit_after_preemption):
            break
        n = req.num_tokens if no_chunking else min(req.num_tokens, budget)
        need = -(-(n if chunk_blocks_only else req.num_tokens) // block_size)
        if need > free:
            if skip_ahead:
                continue
            break
        free -= need
        running.append(req)
        scheduled.append((req.name, n))
        budget -= n
    return scheduled, preempted


def _ps_blocks(p, o, n, bs, shared, common=lambda p, bs: (p - 1) // bs, times_n=True, honour_shared=True):
    own = -(-(p + o) // bs)
    if not shared and honour_shared:
        return n * own
    c = min(common(p, bs), own)
    return c + (n if times_n else 1) * (own - c)


WRONG_02_03 = [
    (paging.check_slot_mapping, _slots_swapped, "`//` and `%` are swapped"),
    (paging.check_slot_mapping, _slots_block_not_scaled, "multiply it by block_size"),
    (paging.check_slot_mapping, _slots_no_table, "look its block up in the block table"),
    (paging.check_slot_mapping, lambda t, ps, bs: [t[p // bs] * bs + p % bs + 0.4 for p in ps],
     r"slot_mapping: 28\.4 is not a whole number"),
    (paging.check_paged_attention, lambda *a: _paged(*a, offset=False), "check 2/8"),
    (paging.check_paged_attention, lambda *a: _paged(*a, interleave=False), "repeat_interleave"),
    (paging.check_paged_attention, lambda *a: _paged(*a, whole_blocks=True), r"0 \* NaN is NaN"),
    (paging.check_paged_attention, lambda *a: _paged(*a, scale=False), "check 1/8"),
    (paging.check_prefix_allocator, _allocator_with(verify=False), "compare the cached block's tokens"),
    (paging.check_prefix_allocator, _allocator_with(keep_last=False), "drop the last hit"),
    (paging.check_prefix_allocator, _allocator_with(evict=False), "check 6/11 .*MemoryError"),
    (paging.check_prefix_allocator, _allocator_with(lru=False), "check 6/11"),
    (paging.check_prefix_allocator, _allocator_with(tail_first=False), "check 6/11"),
    (paging.check_prefix_allocator, _allocator_with(stop_at_miss=False), "(?s)check 8/11.*break, not continue"),
    (paging.check_prefix_allocator, _allocator_with(park_cached=False),
     "(?s)check 5/11.*blocks in `evictable`.*goes to the evictable LRU"),
    (paging.check_prefix_allocator, _allocator_with(unpark=False), "num_free_blocks is"),
    (paging.check_prefix_allocator, _allocator_with(uncache_evicted=False), "blocks in the prefix cache"),
    (paging.check_schedule_step, lambda *a: _schedule(*a, oldest_victim=True), "preempt running\\[-1\\]"),
    (paging.check_schedule_step, lambda *a: _schedule(*a, admit_after_preemption=True), "admit nobody"),
    (paging.check_schedule_step, lambda *a: _schedule(*a, skip_ahead=True), "no skipping ahead"),
    (paging.check_schedule_step, lambda *a: _schedule(*a, chunk_blocks_only=True), "whole prompt"),
    (paging.check_schedule_step, lambda *a: _schedule(*a, no_chunking=True), "chunked prefill"),
    (paging.check_schedule_step, lambda *a: _schedule(*a, keep_victim_blocks=True), "add its blocks"),
    (paging.check_schedule_step, lambda *a: _schedule(*a, in_place=True), "modified the `running`"),
    (paging.check_parallel_sampling_blocks, lambda *a: _ps_blocks(*a, common=lambda p, bs: p // bs),
     "never taken from the cache"),
    (paging.check_parallel_sampling_blocks, lambda *a: _ps_blocks(*a, common=lambda p, bs: -(-p // bs)),
     "partly filled block cannot be shared"),
    (paging.check_parallel_sampling_blocks, lambda *a: _ps_blocks(*a, common=lambda p, bs: 0),
     "held once, not once per completion"),
    (paging.check_parallel_sampling_blocks, lambda *a: _ps_blocks(*a, times_n=False), "multiply them by n"),
    (paging.check_parallel_sampling_blocks, lambda *a: _ps_blocks(*a, honour_shared=False), "no prefix cache"),
    (paging.check_forking_allocator, _forking_with(add_refs=False), r"(?s)check 1/9.*ref_count"),
    (paging.check_forking_allocator, _forking_with(own_table=False), r"(?s)check 2/9.*list\(\.\.\.\)"),
    (paging.check_forking_allocator, _forking_with(own_hashes=False), r"(?s)check 3/9.*copy seq_hashes too"),
    (paging.check_forking_allocator, _forking_with(copy_private=True), r"(?s)check 4/9.*expected None"),
    (paging.check_forking_allocator, _forking_with(drop_ref=False), r"(?s)check 3/9.*drop one reference from it"),
    (paging.check_forking_allocator, _forking_with(replace=False), r"(?s)check 3/9.*table\[index\] = fresh"),
]


@pytest.mark.parametrize("grader, wrong, match", WRONG_02_03, ids=[m for _, _, m in WRONG_02_03])
def test_02_03_graders_reject_classic_mistakes(grader, wrong, match, capsys):
    test_graders_reject_classic_mistakes(grader, wrong, match, capsys)


def test_02_03_graders_accept_the_correct_variants():
    paging.check_slot_mapping(lambda t, ps, bs: torch.tensor([t[p // bs] * bs + p % bs for p in ps]))  # a tensor
    paging.check_paged_attention(_paged)
    paging.check_prefix_allocator(_Allocator)
    paging.check_schedule_step(_schedule)
    paging.check_parallel_sampling_blocks(_ps_blocks)
    paging.check_forking_allocator(_forking_with())
