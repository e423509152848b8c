"""The learner's pieces inside the engine (``minifer_course.workbench``, ``minifer_course.grading.engine``): every
solution piece of the exercises, plugged into ``LLM(components=...)``, gives the reference engine's tokens; a wrong one
is stopped by its grader, with the grader's hint, before it reaches the engine; the untouched stubs fail as "not
implemented yet"; a piece that passes its grader but breaks in the engine is named; saved pieces survive a restart
(a fresh namespace), and ``solution=True`` fills the gaps.

The pieces are taken from the exercise sources themselves (``tools/build_exercises.py`` renders each twin's cells),
so these tests follow the notebooks.
"""

from __future__ import annotations

import ast
import linecache
import sys
from pathlib import Path

import pytest
import torch

from minifer_course import workbench, workbench_save
from minifer_course.grading import engine as graded

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import build_exercises as bx  # noqa: E402

NOTEBOOKS = sorted({p.notebook for p in workbench.PIECES.values()})
SERVED = [name for name, piece in workbench.PIECES.items() if piece.served]


def _check(name: str, piece) -> None:
    """The exercise's last check of ``piece``: in the engine, or on its own where the engine has no seam for it."""
    (graded.check_in_engine if workbench.PIECES[name].served else graded.check_on_its_own)(name, piece)


def _pieces(variant: str) -> dict:
    scope = definitions(variant, NOTEBOOKS)
    return {name: scope[name] for name in workbench.PIECES}


def definitions(variant: str, stems, scope: dict | None = None) -> dict:
    """The definitions (functions, classes, imports) of the cells of exercises ``stems`` in ``variant``, run as a
    notebook would run them (in ``scope``): each cell registered in ``linecache`` under its own name, so their
    source can be saved."""
    scope = {"__name__": f"cells_{variant}", **(scope or {})}
    for stem in stems:
        text = (ROOT / "exercises" / "source" / f"{stem}.py").read_text()
        for i, cell in enumerate(bx.parse_source(text, stem)):
            code = bx.render_cell(cell, variant, stem)
            if code is None or cell.kind != "code":
                continue
            tree = ast.parse(code)
            keep = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom))]
            if not keep:
                continue
            lines = code.splitlines(True)
            src = "".join("".join(lines[(n.decorator_list[0].lineno if getattr(n, "decorator_list", None)
                                         else n.lineno) - 1 : n.end_lineno]) + "\n" for n in keep)
            name = f"<{variant} {stem} cell {i}>"
            linecache.cache[name] = (len(src), None, src.splitlines(True), name)
            exec(compile(src, name, "exec", dont_inherit=True), scope)
    return scope


@pytest.fixture(scope="module")
def solutions():
    return _pieces("solution")


@pytest.fixture(scope="module")
def stubs():
    return _pieces("exercise")


@pytest.fixture(autouse=True)
def my_engine(tmp_path, monkeypatch):
    monkeypatch.setenv(workbench.FOLDER_ENV, str(tmp_path / "my_engine"))
    return tmp_path / "my_engine"


# --- each piece in the engine ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", SERVED)
def test_every_solution_piece_serves_the_reference_tokens(name, solutions, capsys):
    graded.check_in_engine(name, solutions[name])
    out = capsys.readouterr().out
    assert out.rstrip().endswith("checks passed"), out
    assert "tokens are the reference engine's" in out


@pytest.mark.parametrize("name", [n for n in workbench.PIECES if n not in SERVED])
def test_a_piece_without_a_seam_is_saved_and_graded_on_its_own(name, solutions, my_engine, capsys):
    graded.check_on_its_own(name, solutions[name])
    out = capsys.readouterr().out
    assert out.rstrip().endswith("checks passed") and "the engine serves" not in out, out
    assert (my_engine / f"{name}.py").is_file()
    with pytest.raises(ValueError, match="no seam for it; use check_on_its_own"):
        graded.check_in_engine(name, solutions[name])
    with pytest.raises(ValueError, match="plugs into the engine"):
        graded.check_on_its_own("rms_norm", solutions["rms_norm"])


@pytest.mark.parametrize("name", list(workbench.PIECES))
def test_an_untouched_stub_is_a_graded_failure_not_a_crash(name, stubs, my_engine, monkeypatch):
    monkeypatch.setenv(workbench_save.CHECK_ENV, "0")  # a stub's file runs: test_workbench_save.py checks one
    gate = "does not go into the engine" if name in SERVED else "it fails its checks"
    with pytest.raises(AssertionError, match=f"(?s){gate}.*not implemented yet"):
        _check(name, stubs[name])
    assert (my_engine / f"{name}.py").is_file()  # saved all the same: the capstone grades it again


def _rms_no_eps(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True))).to(x.dtype)


def _rotary_interleaved(x, cos, sin):
    rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _top_p_strict(logits, top_p):
    probs, order = logits.softmax(-1).sort(-1, descending=True)
    drop = probs.cumsum(-1) > top_p[:, None]  # drops the token that crosses p
    drop[:, 0] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


def _layer_without_residual(layer, x, cos, sin, attn):
    from minifer.models.llama import DecoderLayer

    return DecoderLayer.forward(layer, x, cos, sin, attn) - x


def _verify_no_bonus(draft_tokens, target_argmax):
    out = []
    for i, d in enumerate(draft_tokens):
        row = target_argmax[i].tolist()
        n = next((j for j, t in enumerate(d) if t != row[j]), len(d))
        out.append(d[:n])  # forgets the target's own token after the agreeing prefix
    return out


def _ngram_first_occurrence(token_ids, k, prompt_lookup_max, prompt_lookup_min):
    for n in range(prompt_lookup_max, prompt_lookup_min - 1, -1):
        if n >= len(token_ids):
            continue
        pattern = token_ids[len(token_ids) - n:]
        for i in range(len(token_ids) - n):  # the earliest occurrence, not the most recent
            if token_ids[i:i + n] == pattern:
                return token_ids[i + n:i + n + k]
    return []


def _schedule_no_preemption(running, waiting, free_blocks, block_size, max_num_seqs, token_budget):
    scheduled = [(r.name, min(r.num_tokens - r.num_computed, token_budget)) for r in running]
    return scheduled, []


def _rollback_keeps_the_bonus_kv(token_ids, k, accepted, target, draft):
    from minifer_course.grading.spec_step import reference_rollback

    reference_rollback(token_ids, k, accepted, target, draft)
    target.num_tokens += 1  # the off-by-one: the KV of the token the target emits next is not there yet


def _eagle_without_norm(head, features, input_ids, positions, attn):
    x = head.fc(torch.cat([features, head.embed_tokens(input_ids)], dim=-1))
    return head.layer(x, *head.rotary(positions, x.dtype), attn)


def _wrong(solutions) -> dict:
    """A classic mistake per piece (the graders' own tests hold many more)."""
    def paged_unscaled(q, k_cache, v_cache, block_table, context_len):
        return solutions["paged_attention"](q * q.shape[-1] ** 0.5, k_cache, v_cache, block_table, context_len)

    class NoVerifyAllocator(solutions["PrefixCachingAllocator"]):
        def lookup_prefix(self, tokens):
            bs, hits = self.block_size, []
            for h in self.full_block_hashes(tokens):
                if h not in self.cache:
                    break
                hits.append(self.cache[h])  # trusts the hash: never compares the tokens
            return hits[:-1] if hits and len(hits) * bs >= len(tokens) else hits

    class NoCopyOnWrite(solutions["ForkingAllocator"]):
        def copy_on_write(self, seq_id, position):
            return None

    def preempt_oldest(running, waiting, blocks):
        victim = running.pop(0)  # the oldest
        blocks.free(victim.request_id)
        victim.status, victim.num_computed_tokens = type(victim.status).WAITING, 0
        waiting.appendleft(victim)
        return victim

    def update_never_frees(self, batch, sampled, result, tokenizer=None):
        self.finish = lambda seq: None  # the scheduler, with finish() forgotten
        try:
            return solutions["update_from_output"](self, batch, sampled, result, tokenizer)
        finally:
            del self.finish

    def rejection_always_accept(draft_tokens, q, p, generator):
        return list(draft_tokens) + [int(torch.multinomial(p[len(draft_tokens)], 1, generator=generator))]

    def inv_freq_over_pairs(head_dim, theta):  # the exponent 2i / (head_dim / 2): frequencies fall twice as fast
        return 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / (head_dim // 2))

    return {"rms_norm": _rms_no_eps, "rope_inv_freq": inv_freq_over_pairs, "apply_rotary": _rotary_interleaved, "top_p_mask": _top_p_strict,
            "decoder_layer": _layer_without_residual,
            "paged_attention": paged_unscaled, "PrefixCachingAllocator": NoVerifyAllocator,
            "ForkingAllocator": NoCopyOnWrite, "schedule_step": _schedule_no_preemption,
            "preempt": preempt_oldest, "update_from_output": update_never_frees,
            "verify_greedy": _verify_no_bonus, "rejection_sample": rejection_always_accept,
            "ngram_propose": _ngram_first_occurrence,
            "rollback": _rollback_keeps_the_bonus_kv, "eagle_forward": _eagle_without_norm}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(workbench.PIECES))
def test_a_wrong_piece_is_stopped_by_its_grader_with_a_hint(name, solutions, capsys, monkeypatch):
    monkeypatch.setenv(workbench_save.CHECK_ENV, "0")  # graded here already: its file is not run again
    wrong = _wrong(solutions)[name]
    with pytest.raises(AssertionError) as err:
        _check(name, wrong)
    message = str(err.value)
    assert ("does not go into the engine until it passes its checks" if name in SERVED else "it fails its checks") \
        in message
    assert "check 1/" in message and graded.grade_quietly(name, wrong) in message  # the grader's own words
    assert "the engine serves" not in capsys.readouterr().out.split("FAIL")[0]  # it never ran


_calls = {"n": 0}


def _rms_breaks_in_the_engine(x, weight, eps):
    """Right on the grader's small inputs, wrong on a whole batch of hidden states (as a shape bug would be)."""
    if x.shape[0] > 40:
        raise IndexError("index 40 is out of bounds")
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def test_a_piece_that_breaks_inside_the_engine_is_named_with_a_hint():
    with pytest.raises(AssertionError, match="(?s)the engine stopped inside your rms_norm: IndexError.*hint: it passes"):
        graded.check_in_engine("rms_norm", _rms_breaks_in_the_engine)


# --- carried forward ---------------------------------------------------------------------------------------


def test_saved_pieces_load_in_a_fresh_namespace_and_keep_their_helpers(solutions, my_engine):
    workbench.save(solutions["rms_norm"], solutions["PrefixCachingAllocator"], solutions["ForkingAllocator"])
    loaded = workbench.load_saved()
    assert set(loaded) == {"rms_norm", "PrefixCachingAllocator", "ForkingAllocator"}
    x, w = torch.randn(3, 8), torch.randn(8)
    assert torch.equal(loaded["rms_norm"](x, w, 1e-6), solutions["rms_norm"](x, w, 1e-6))
    assert "def chain_hash" in (my_engine / "PrefixCachingAllocator.py").read_text()  # its default hash_fn
    # the class it extends is a piece of its own: saved as that piece, and named as needed, not copied
    assert "# it builds on the saved pieces: PrefixCachingAllocator" in (my_engine / "ForkingAllocator.py").read_text()
    assert issubclass(loaded["ForkingAllocator"], loaded["PrefixCachingAllocator"])
    graded.GRADERS["ForkingAllocator"](loaded["ForkingAllocator"])  # the loaded class still passes its checks


def test_a_piece_saved_with_an_older_seams_signature_is_refused_with_what_to_resave(solutions, my_engine):
    my_engine.mkdir(parents=True)
    (my_engine / "decoder_layer.py").write_text("def decoder_layer(layer, x, cos, sin, attn, ops):\n    return x\n")
    errors: dict[str, str] = {}
    assert "decoder_layer" not in workbench.load_saved(errors=errors)  # never called with the wrong arguments
    assert "takes (layer, x, cos, sin, attn, ops)" in errors["decoder_layer"]
    assert "now takes (layer, x, cos, sin, attn)" in errors["decoder_layer"]
    assert "exercises/00_building_blocks.ipynb" in errors["decoder_layer"]
    with pytest.raises(AssertionError, match="decoder_layer: the saved .* signature of an older exercise"):
        graded.sort_saved({}, errors, {"decoder_layer": workbench.PIECES["decoder_layer"]}, solution=False)
    workbench.save(solutions["decoder_layer"])
    assert "decoder_layer" in workbench.load_saved()


def test_a_saved_file_that_does_not_run_is_reported(my_engine):
    my_engine.mkdir(parents=True)
    (my_engine / "rms_norm.py").write_text("def rms_norm(x, weight, eps):\n    return undefined_name +\n")
    with pytest.raises(AssertionError, match="rms_norm: the saved .*rms_norm.py does not run"):
        graded.load_pieces()


@pytest.mark.parametrize("source, old, new", [
    ("from minifer.engine.sequence import SequenceStatus\n\ndef schedule_step(running, waiting):\n    return []\n",
     "minifer.engine.sequence", "minifer.request"),
    ("def schedule_step(running, waiting):\n    return []\n\nSequenceStatus.WAITING\n",
     "SequenceStatus", "RequestStatus"),
])
def test_a_piece_saved_against_a_renamed_module_or_class_says_what_it_is_now(source, old, new, my_engine):
    my_engine.mkdir(parents=True)
    (my_engine / "schedule_step.py").write_text(source)
    errors: dict[str, str] = {}
    assert "schedule_step" not in workbench.load_saved(errors=errors)
    assert f"({old} is now {new}, docs/structure.md)" in errors["schedule_step"]
    assert "exercises/03_continuous_batching.ipynb" in errors["schedule_step"]


def test_the_solution_switch_fills_every_gap_with_minifers_piece(stubs):
    with pytest.raises(AssertionError, match="(?s)rms_norm: not implemented yet.*solution=True"):
        graded.load_pieces()
    workbench.save(stubs["apply_rotary"])
    pieces, origin = graded.load_pieces(solution=True)
    assert pieces == {}
    assert origin["rms_norm"] == "minifer's (not saved yet)"
    assert origin["apply_rotary"] == "minifer's (yours fails its checks)"
    reasons: dict[str, str] = {}
    graded.load_pieces(solution=True, reasons=reasons)
    assert list(reasons) == ["apply_rotary"] and "apply_rotary: not implemented yet" in reasons["apply_rotary"]
    assert workbench.components_from(pieces).given() == {}  # the reference engine


@pytest.mark.slow
def test_the_capstone_runs_every_solution_piece_together(solutions, capsys):
    for name, piece in solutions.items():
        workbench.save(piece, name=name)
    graded.check_capstone()
    assert capsys.readouterr().out.rstrip().endswith("checks passed")
    assert set(graded._last_origin.values()) == {"yours"}
    assert "PrefixCachingAllocator" not in graded._last_origin  # the forking allocator extends it and runs instead
