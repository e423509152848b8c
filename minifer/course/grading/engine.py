"""Graders that run the learner's pieces inside the real engine (``minifer.course.workbench``).

``check_in_engine(name, piece)`` ends every exercise that rebuilds an engine piece: it saves the piece (the capstone
finds it there), grades it with its exercise's checks, then serves the chapter's workload through
``LLM(components=...)`` with that piece and compares the tokens with the reference engine's (and, for greedy
workloads, with transformers'). ``check_capstone`` does the same with every saved piece at once. The report holds
no measured value, so nbval compares it; the throughput is printed apart (``workbench.piece_throughput``,
``capstone_throughput``), never asserted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from minifer.course import workbench
from minifer.course.grading import batching, building_blocks, paging, spec
from minifer.course.grading.base import run_checks
from minifer.course.workbench import CAPSTONE, PROMPTS, WORKLOADS, Workload, engine, reference_llm, tokens

GRADERS: dict[str, Callable[[Any], None]] = {
    "rms_norm": building_blocks.check_rms_norm, "apply_rotary": building_blocks.check_apply_rotary,
    "top_p_mask": building_blocks.check_top_p, "decoder_layer": building_blocks.check_decoder_layer,
    "paged_attention": paging.check_paged_attention,
    "PrefixCachingAllocator": paging.check_prefix_allocator, "ForkingAllocator": paging.check_forking_allocator,
    "schedule_step": batching.check_schedule_step, "preempt": batching.check_preempt,
    "engine_step": batching.check_engine_step, "verify_greedy": spec.check_verify_greedy,
    "rejection_sample": spec.check_rejection_sample, "ngram_propose": spec.check_ngram_propose,
}


def grade_quietly(name: str, obj: Any) -> str | None:
    """None when ``obj`` passes its exercise's checks, else the grader's message (with its hint)."""
    import contextlib
    import io

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            GRADERS[name](obj)
    except AssertionError as e:
        return str(e)
    return None


def load_pieces(solution: bool = False, path=None) -> tuple[dict[str, Any], dict[str, str]]:
    """The learner's saved pieces that pass their checks, and where each piece comes from: ``"yours"``, or with
    ``solution=True`` ``"minifer's (...)"`` for one not saved or failing its checks. Without ``solution`` a missing
    or failing piece raises ``AssertionError`` with the grader's message. The allocator is one piece: the
    ``ForkingAllocator`` when it is saved (it extends the ``PrefixCachingAllocator``), else the latter."""
    broken: dict[str, str] = {}
    saved = workbench.load_saved(path, broken)
    skip = "PrefixCachingAllocator" if "ForkingAllocator" in saved else "ForkingAllocator"
    pieces, origin = {}, {}
    for name, piece in workbench.PIECES.items():
        if name == skip:
            continue
        if name in broken:
            problem = broken[name]
        elif name not in saved:
            problem = (f"{name}: not implemented yet (nothing saved in {workbench.folder(path)}/: run its "
                       f"`in the engine` check cell in exercises/{piece.notebook}.ipynb)")
        else:
            problem = grade_quietly(name, saved[name])
        if problem is None:
            pieces[name], origin[name] = saved[name], "yours"
        elif solution:
            origin[name] = "minifer's (" + ("not saved yet" if name not in saved else "yours fails its checks") + ")"
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
    served: dict[str, list[list[int]]] = {}

    def run() -> None:
        try:
            served["tokens"] = tokens(engine(components(), workload), workload)
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
    return checks


def check_in_engine(name: str, piece: Any) -> None:
    """Save ``piece`` (the exercise's ``name``), grade it, and serve the chapter's workload with it in the engine."""
    try:
        workbench.save(piece, name=name)
    except (OSError, TypeError):  # no source to save (a lambda, a built-in): it is graded and served all the same
        pass
    spec = workbench.PIECES[name]

    def graded() -> None:
        problem = grade_quietly(name, piece)
        if problem is not None:
            raise AssertionError(f"it does not go into the engine until it passes its checks:\n{problem}")

    hint = (f"it passes the checks of {spec.notebook}, but the engine calls it on shapes or states they do not cover; "
            f"rerun the check cell of {name} after changing it")
    checks = [(f"your {name} passes its checks (saved for the capstone)", graded)]
    checks += _serve_checks(f"your {name}", lambda: workbench.components_from({name: piece}), WORKLOADS[name], hint)
    run_checks(f"{name} in the engine", checks)


# The latest capstone's pieces and where each came from (``print_origins`` and ``capstone_throughput`` reuse them
# rather than grade every piece again).
_last_pieces: dict[str, Any] = {}
_last_origin: dict[str, str] = {}


def check_capstone(solution: bool = False) -> None:
    """Every saved piece at once (``solution=True`` fills the missing ones with minifer's): the capstone's batches of
    requests, token for token the reference engine's."""
    pieces: dict[str, Any] = {}

    def loaded() -> None:
        found, where = load_pieces(solution)
        pieces.update(found)
        _last_pieces.clear()
        _last_pieces.update(found)
        _last_origin.clear()
        _last_origin.update(where)

    checks = [("every piece is saved and passes its checks" if not solution else
               "the saved pieces are graded; minifer's fill the gaps (solution=True)", loaded)]
    for workload in CAPSTONE:
        checks += _serve_checks("your engine", lambda w=workload: workbench.components_from(
            pieces, speculative=w.speculative), workload,
                                "run each piece's own `in the engine` check cell to find the piece that differs")
    run_checks("your engine", checks)


def print_origins() -> None:
    """Which pieces the latest capstone ran were yours (not a check: it depends on what this folder holds)."""
    if not _last_origin:
        print("the capstone's check has not loaded your pieces yet (run the cell above)")
    for name, where in _last_origin.items():
        print(f"  {name:24} {where}")


def capstone_throughput(solution: bool = False, rounds: int = 3) -> None:
    """The capstone's throughput cell: every piece of yours (minifer's where ``solution`` fills a gap) at once."""
    def components():
        return workbench.components_from(_last_pieces if _last_origin else load_pieces(solution)[0],
                                         speculative=CAPSTONE[0].speculative)

    workbench.report_throughput("your engine", components, CAPSTONE[0], rounds)
