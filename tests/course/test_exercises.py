"""The exercise mechanism: generated notebooks in sync with their sources, solutions that pass their
checks (untouched exercises that fail them: ``test_exercise_stubs.py``), and graders that reject the classic
mistakes.

The graders in ``minifer_course.grading`` are the same functions the notebooks' check cells call; here they
also grade minifer's own implementations (which must pass) and deliberately wrong ones (which must fail).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch

from minifer_course.grading import building_blocks, paging
from minifer.layers.layernorm import rms_norm as ref_rms_norm
from minifer.layers.rotary_embedding import apply_rotary as ref_apply_rotary
from minifer.layers.rotary_embedding import rope_inv_freq as ref_rope_inv_freq
from minifer.sample.sampler import apply_top_p as ref_apply_top_p

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
    """The pieces the notebooks save (``minifer_course.workbench``) go to a temporary folder, one per kind of run
    (the solutions' and the untouched exercises' never mix), as they would to ``my_engine/`` beside the notebooks;
    never to a learner's own folder."""
    from minifer_course import workbench

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

# %% nbval-check-output
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


def _layer_with_minifers_functions(layer, x, cos, sin, attn):
    """Right numbers, but normalising and rotating with minifer's functions, not the layer's own modules: in the
    capstone the learner's RMSNorm and RoPE would be bypassed."""
    att, mlp, n = layer.self_attn, layer.mlp, x.shape[0]

    def norm(module, h):
        return ref_rms_norm(h, module.weight, module.eps)

    q, k, v = att.qkv_proj(norm(layer.input_layernorm, x)).split([att.q_size, att.kv_size, att.kv_size], dim=-1)
    q, k = q.view(n, att.num_heads, att.head_dim), k.view(n, att.num_kv_heads, att.head_dim)
    if att.q_norm is not None:
        q, k = norm(att.q_norm, q), norm(att.k_norm, k)
    q, k = ref_apply_rotary(q, cos, sin), ref_apply_rotary(k, cos, sin)
    h = x + att.o_proj(attn.attend(att.layer_idx, q, k, v.view(n, att.num_kv_heads, att.head_dim)).reshape(n, -1))
    gate, up = mlp.gate_up_proj(norm(layer.post_attention_layernorm, h)).split(mlp.intermediate_size, dim=-1)
    return h + mlp.down_proj(torch.nn.functional.silu(gate) * up)


WRONG = [
    (building_blocks.check_decoder_layer, _layer_with_minifers_functions, "(?s)check 5/5.*layer.input_layernorm"),
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
