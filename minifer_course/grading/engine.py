"""Graders that run the learner's pieces inside the real engine (``minifer_course.workbench``).

``check_in_engine(name, piece)`` ends every exercise that rebuilds an engine piece with a seam: it saves the piece (the
capstone finds it there), grades it with its exercise's checks, then serves the chapter's workload through
``LLM(components=...)`` with that piece and compares the tokens with the reference engine's (and, for greedy
workloads, with transformers'). A piece the engine has no seam for (``workbench.ON_ITS_OWN``: the rollback) ends
with ``check_on_its_own``: saved and graded, not served. ``check_capstone`` grades every saved piece and serves those
with a seam, at once. The report holds no measured value, so nbval compares it; the throughput is printed apart
(``workbench.piece_throughput``, ``capstone_throughput``), never asserted.
"""

from __future__ import annotations

import functools
import textwrap
from collections.abc import Callable
from typing import Any

from minifer_course import workbench
from minifer_course.grading import batching, building_blocks, paging, quant, quant_load, spec, spec_step
from minifer_course.grading.base import nested, run_checks
from minifer_course.workbench import CAPSTONE, PROMPTS, WORKLOADS, Workload, engine, reference_llm, tokens
from minifer_course.workbench_spec import CAPSTONE_EAGLE

GRADERS: dict[str, Callable[[Any], None]] = {
    "rms_norm": building_blocks.check_rms_norm, "rope_inv_freq": building_blocks.check_rope_inv_freq,
    "apply_rotary": building_blocks.check_apply_rotary,
    "top_p_mask": building_blocks.check_top_p, "decoder_layer": building_blocks.check_decoder_layer,
    "paged_attention": paging.check_paged_attention,
    "PrefixCachingAllocator": paging.check_prefix_allocator, "ForkingAllocator": paging.check_forking_allocator,
    "schedule_step": batching.check_schedule_step, "preempt": batching.check_preempt,
    "update_from_output": batching.check_update_from_output, "verify_greedy": spec.check_verify_greedy,
    "rejection_sample": spec.check_rejection_sample, "ngram_propose": spec.check_ngram_propose,
    "rollback": spec_step.check_rollback, "eagle_forward": spec_step.check_eagle_forward,
    "quantize_int4_groupwise": quant.check_quantize_int4, "quantize_linears": quant_load.check_quantize_linears,
    "int4_matmul": quant.check_int4_matmul_kernel,
}


def grade_quietly(name: str, obj: Any) -> str | None:
    """None when ``obj`` passes its exercise's checks, else the grader's message (with its hint); ``Blocked`` is
    raised when a check cannot run here (no Triton)."""
    import contextlib
    import io

    try:
        with contextlib.redirect_stdout(io.StringIO()), nested():
            GRADERS[name](obj)
    except AssertionError as e:
        return str(e)
    return None


def load_pieces(solution: bool = False, path=None,
                reasons: dict[str, str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The learner's saved pieces that pass their checks, and where each piece comes from: ``"yours"``, or with
    ``solution=True`` ``"minifer's (...)"`` for one not saved or failing its checks, why in ``reasons`` (the grader's
    message, with its hint). Without ``solution`` a missing or failing piece raises ``AssertionError`` with it. The allocator is one piece: the
    ``ForkingAllocator`` when it is saved (it extends the ``PrefixCachingAllocator``), else the latter."""
    broken: dict[str, str] = {}
    saved = workbench.load_saved(path, broken)
    skip = "PrefixCachingAllocator" if "ForkingAllocator" in saved else "ForkingAllocator"
    return sort_saved(saved, broken, {n: p for n, p in workbench.PIECES.items() if n != skip}, solution, path,
                      reasons)


def sort_saved(saved: dict[str, Any], broken: dict[str, str], wanted: dict[str, workbench.Piece], solution: bool,
               path=None, reasons: dict[str, str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """``load_pieces``' verdict on each ``wanted`` piece, saved (``saved``) or not, or saved but not running
    (``broken``): graded, and kept, or replaced by minifer's (``solution``, the reason put in ``reasons``), or the
    reason raised."""
    pieces, origin = {}, {}
    for name, piece in wanted.items():
        if name in broken:
            problem = broken[name]
        elif name not in saved:
            cell = "`in the engine`" if piece.served else f"`{workbench.ON_ITS_OWN}`"
            problem = (f"{name}: not implemented yet (nothing saved in {workbench.folder(path)}/: run its "
                       f"{cell} check cell in exercises/{piece.notebook}.ipynb){workbench.retired(name, path)}")
        else:
            problem = grade_quietly(name, saved[name])
        if problem is None:
            pieces[name], origin[name] = saved[name], "yours"
        elif solution:
            origin[name] = "minifer's (" + ("yours does not run" if name in broken else "not saved yet"
                                            if name not in saved else "yours fails its checks") + ")"
            if reasons is not None and (name in saved or name in broken):
                reasons[name] = problem
        else:
            raise AssertionError(problem + "\n(or run the capstone with solution=True: minifer's piece takes its place)")
    return pieces, origin


@functools.lru_cache(maxsize=8)
def reference_tokens(workload: Workload) -> list[list[int]]:
    return tokens(engine(None, workload), workload)


@functools.lru_cache(maxsize=4)
def transformers_tokens(max_tokens: int, count: int = 2) -> list[list[int]]:
    """transformers' greedy continuation of the first ``count`` prompts (float32, as the engine runs on a CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    llm = reference_llm()
    hf = _quietly_loaded(AutoModelForCausalLM, str(llm.model_path))
    hf.generation_config.eos_token_id = None  # as the engine's ignore_eos: an EOS is a token like any other
    out = []
    for prompt in PROMPTS[:count]:
        ids = torch.tensor([llm.get_tokenizer()(prompt)["input_ids"]])
        with torch.inference_mode():
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                            pad_token_id=0)
        out.append(g[0, ids.shape[1]:].tolist())
    return out


def _quietly_loaded(auto_class, path: str):
    """``from_pretrained`` without its progress bar: a check cell's stored output must be the same every run."""
    import torch
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return auto_class.from_pretrained(path, dtype=torch.float32).eval()
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _first_difference(got: list[list[int]], want: list[list[int]]) -> str:
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            j = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            return f"request {i} ({PROMPTS[i]!r}) differs first at output token {j}: got {g[j:j + 3]}, expected {w[j:j + 3]}"
    return "the number of requests differs"


def _serve_checks(label: str, components: Callable[[], Any], workload: Workload, hint: str) -> list:
    """Run the workload on the engine with ``components``; compare with the reference engine and transformers."""
    def reference_engine():  # the reference engine, having served the workload (an engine check reads its stats)
        llm = engine(None, workload)
        tokens(llm, workload)
        return llm

    served: dict[str, Any] = {"reference": reference_engine}

    def run() -> None:
        try:
            served["llm"] = engine(components(), workload)
            served["tokens"] = tokens(served["llm"], workload)
        except Exception as e:
            raise AssertionError(f"the engine stopped inside {label}: {type(e).__name__}: {e}\n"
                                 f"hint: {hint}") from e

    def same_as_reference() -> None:
        want = reference_tokens(workload)
        if served["tokens"] != want:
            raise AssertionError(f"{label} changes what the engine generates: {_first_difference(served['tokens'], want)}"
                                 f"\nhint: {hint}")

    def same_as_transformers() -> None:
        want = transformers_tokens(workload.max_tokens)
        if served["tokens"][: len(want)] != want:
            raise AssertionError(f"transformers generates other tokens: {_first_difference(served['tokens'], want)}")

    checks = [(f"the engine serves {workload.describe()}", run),
              ("its tokens are the reference engine's, request by request", same_as_reference)]
    if not workload.sampled:
        checks.append(("greedy tokens identical to transformers' (first 2 prompts)", same_as_transformers))
    return checks + (workload.engine_checks(served) if hasattr(workload, "engine_checks") else [])


def saved_and_graded(name: str, piece: Any, save: Callable[..., Any], notebook: str,
                     served: bool = True) -> tuple[list, str]:
    """The start of every piece's check in the engine: ``save(piece, name=name)`` (for the capstone), the check that
    it passes its grader (so a wrong piece stops with the grader's hint, before any engine runs it), and the hint for
    a piece that passes and then fails in the engine."""
    try:
        problem: str | Exception | None = grade_quietly(name, piece)
    except Exception as e:  # Blocked, or a grader that stopped: raised again by its check, which reports it
        problem = e
    try:
        save(piece, name=name, grade=problem is None)  # passing here, it must pass from its file too
    except (OSError, TypeError):  # no source to save (a lambda, a built-in): it is graded and served all the same
        pass
    except workbench.PieceRefused as e:  # after its grader's verdict, which says more when it fails
        problem = problem or AssertionError(f"it runs in this notebook only:\n{e}")

    def graded() -> None:
        if isinstance(problem, Exception):
            raise problem
        if problem is not None:
            gate = "it does not go into the engine until it passes its checks" if served else "it fails its checks"
            raise AssertionError(f"{gate}:\n{problem}")

    hint = (f"it passes the checks of {notebook}, but the engine calls it on shapes or states they do not cover; "
            f"rerun the check cell of {name} after changing it")
    return [(f"your {name} passes its checks (saved for the capstone)", graded)], hint


def check_in_engine(name: str, piece: Any) -> None:
    """Save ``piece`` (the exercise's ``name``), grade it, and serve the chapter's workload with it in the engine."""
    if not workbench.PIECES[name].served:
        raise ValueError(f"{name} is {workbench.ON_ITS_OWN}: the engine has no seam for it; use check_on_its_own")
    checks, hint = saved_and_graded(name, piece, workbench.save, workbench.PIECES[name].notebook)
    spec_config = getattr(WORKLOADS[name], "speculative_config", None)  # a workload with its own drafter
    checks += _serve_checks(f"your {name}", lambda: workbench.components_from({name: piece}, spec_config),
                            WORKLOADS[name], hint)
    run_checks(f"{name} in the engine", checks)


def check_on_its_own(name: str, piece: Any) -> None:
    """Save ``piece`` (for the capstone, which grades it again) and grade it: a piece the engine has no seam for."""
    if workbench.PIECES[name].served:
        raise ValueError(f"{name} plugs into the engine ({workbench.PIECES[name].seam}): use check_in_engine")
    checks, _ = saved_and_graded(name, piece, workbench.save, workbench.PIECES[name].notebook, served=False)
    run_checks(f"{name}, {workbench.ON_ITS_OWN}", checks)


# The latest capstone's pieces and where each came from (``print_origins`` and ``capstone_throughput`` reuse them
# rather than grade every piece again).
_last_pieces: dict[str, Any] = {}
_last_origin: dict[str, str] = {}
_last_reasons: dict[str, str] = {}  # why minifer's piece ran in place of a saved one of yours


def check_capstone(solution: bool = False) -> None:
    """Every saved piece at once (``solution=True`` fills the missing ones with minifer's): the capstone's batches of
    requests, token for token the reference engine's."""
    pieces: dict[str, Any] = {}

    def loaded() -> None:
        _last_reasons.clear()
        found, where = load_pieces(solution, reasons=_last_reasons)
        pieces.update(found)
        _last_pieces.clear()
        _last_pieces.update(found)
        _last_origin.clear()
        _last_origin.update(where)

    checks = [("every piece is saved and passes its checks" if not solution else
               "the saved pieces are graded; minifer's fill the gaps (solution=True)", loaded)]
    for workload in CAPSTONE + CAPSTONE_EAGLE:  # the last: the same pieces, drafting with your EAGLE head
        spec_config = getattr(workload, "speculative_config", None)
        checks += _serve_checks("your engine", lambda w=workload, s=spec_config: workbench.components_from(
            pieces, s, speculative=w.speculative), workload,
                                "run each piece's own `in the engine` check cell to find the piece that differs")
    run_checks("your engine", checks)


def print_origins() -> None:
    """Which pieces the latest capstone ran were yours, and the seam each went through (not a check: it depends on
    what this folder holds)."""
    if not _last_origin:
        print("the capstone's check has not loaded your pieces yet (run the cell above)")
    for name, where in _last_origin.items():
        piece = workbench.PIECES[name]
        print(f"  {name:24} {where:36} {piece.seam}{f': {piece.via}' if piece.via else ''}")
        print_reason(_last_reasons.get(name))


def print_reason(reason: str | None) -> None:
    """Why a saved piece did not run, under its row: the grader's message and hint, indented."""
    if reason:
        print(textwrap.indent(reason, " " * 6))


def capstone_throughput(solution: bool = False, rounds: int = 3) -> None:
    """The capstone's throughput cell: every piece of yours (minifer's where ``solution`` fills a gap) at once."""
    def components():
        return workbench.components_from(_last_pieces if _last_origin else load_pieces(solution)[0],
                                         speculative=CAPSTONE[0].speculative)

    workbench.report_throughput("your engine", components, CAPSTONE[0], rounds)
