"""Exercise 05's pieces serving requests: the learner's quantizer, load step and int4 kernel in an int4
``LLM("tinystories-target", ...)`` (``minifer_course.workbench_quant.int4_llm``).

int4 is not float32, so the reference is minifer's own int4 engine (its quantizer, its load step, the reference
kernel): greedy tokens equal, request by request. The weights are bit for bit minifer's (each piece passed its
grader, which asks for minifer's exact bytes), so only the kernel's float32 summation order can differ; that
difference is bounded teacher-forced: every token of the reference's output is scored by both engines
(``prompt_logprobs``) and their log-probabilities may differ by ``LOGPROB_TOLERANCE`` at most. A wrong piece is
stopped by its grader, with the grader's hint, before it reaches the engine. The reports hold no measured value
(nbval compares them); the throughput is printed apart and never asserted.

Under Triton's CPU interpreter the kernel costs about a second per step of the bundled model, so these checks
serve a small batch: ``INT4_PROMPTS``, ``INT4_MAX_TOKENS`` greedy tokens each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from minifer_course import workbench_quant
from minifer_course.grading.base import Check, run_checks
from minifer_course.grading.engine import print_reason, saved_and_graded, sort_saved
from minifer_course.workbench import PROMPTS, interleaved_ratio, print_ratio

INT4_PROMPTS = PROMPTS[:4]
INT4_MAX_TOKENS = 8
# float32 in another summation order: 1.8e-6 nats at most on this batch, measured with the exercise's solution
# under the interpreter (a wrong dequantization is off by tenths of a nat or more); the bound leaves room for other
# machines' orders
LOGPROB_TOLERANCE = 1e-3


def describe() -> str:
    return f"{len(INT4_PROMPTS)} greedy requests of {INT4_MAX_TOKENS} tokens, int4 g128 weights"


def _params(**kw: Any):
    from minifer import SamplingParams

    return SamplingParams(**{"temperature": 0, "max_tokens": INT4_MAX_TOKENS, "ignore_eos": True, **kw})


@functools.lru_cache(maxsize=1)
def reference_int4_llm():
    """minifer's int4 engine: its quantizer and load step, the reference kernel on the CPU (Triton's on a GPU)."""
    from minifer import LLM

    return LLM("tinystories-target", quantization="int4", dtype="float32")  # float32 on a GPU too: the kernels' sums


def int4_engine(pieces: dict[str, Any]):
    """An int4 engine with these pieces; it loads its own weights, since the learner's pieces quantize them."""
    return workbench_quant.int4_llm(pieces)


def int4_tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(INT4_PROMPTS, _params(), use_tqdm=False)]


@functools.lru_cache(maxsize=1)
def reference_int4_tokens() -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(t) for t in int4_tokens(reference_int4_llm()))


def teacher_forced_logprobs(llm, outputs) -> list[list[float]]:
    """The log-probability ``llm`` gives each token of ``outputs`` (the reference's), after its prompt and the
    outputs before it: one prefill of prompt + output per request (``prompt_logprobs``)."""
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok(p)["input_ids"] + list(out)} for p, out in zip(INT4_PROMPTS, outputs)]
    results = llm.generate(prompts, _params(prompt_logprobs=0, max_tokens=1), use_tqdm=False)
    scored = []
    for prompt, out, result in zip(prompts, outputs, results):
        ids = prompt["prompt_token_ids"]
        entries = result.prompt_logprobs[len(ids) - len(out):]
        scored.append([entry[t].logprob for entry, t in zip(entries, out)])
    return scored


def _first_difference(got: list[list[int]], want: tuple[tuple[int, ...], ...]) -> str:
    for i, (g, w) in enumerate(zip(got, want)):
        if list(g) != list(w):
            j = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            return f"request {i} ({INT4_PROMPTS[i]!r}) differs first at output token {j}: got {list(g[j:j + 3])}, " \
                   f"expected {list(w[j:j + 3])}"
    return "the number of requests differs"


def serve_checks(label: str, pieces: Callable[[], dict[str, Any]], hint: str) -> list[Check]:
    """Serve the int4 batch with ``pieces``; compare tokens with minifer's int4 engine and bound the logprobs."""
    served: dict[str, Any] = {}

    def run() -> None:
        try:
            served["llm"] = int4_engine(pieces())
            served["tokens"] = int4_tokens(served["llm"])
        except AssertionError:
            raise
        except Exception as e:
            raise AssertionError(f"the engine stopped inside {label}: {type(e).__name__}: {e}\nhint: {hint}") from e

    def same_tokens() -> None:
        want = reference_int4_tokens()
        if [list(t) for t in served["tokens"]] != [list(t) for t in want]:
            raise AssertionError(f"{label} changes what the engine generates: "
                                 f"{_first_difference(served['tokens'], want)}\nhint: {hint}")

    def close_logprobs() -> None:
        want = reference_int4_tokens()
        ref = teacher_forced_logprobs(reference_int4_llm(), want)
        got = teacher_forced_logprobs(served["llm"], want)
        worst = max((abs(a - b), i, j) for i, (g, r) in enumerate(zip(got, ref)) for j, (a, b) in enumerate(zip(g, r)))
        if worst[0] > LOGPROB_TOLERANCE:
            raise AssertionError(
                f"request {worst[1]}, output token {worst[2]}: log-probability {worst[0]:.2g} nats away from "
                f"minifer's int4 engine's (bound {LOGPROB_TOLERANCE})\nhint: the weights are minifer's, so the "
                f"products are not float32's: load x and the scales as float32, dequantize and accumulate in float32 "
                f"(on a GPU, tl.dot(..., input_precision=\"ieee\"): tf32 and bf16 keep 10 and 7 bits)")

    return [(f"the int4 engine serves {describe()}", run),
            ("its tokens are minifer's int4 engine's, request by request", same_tokens),
            (f"teacher-forced, every output token's log-probability within {LOGPROB_TOLERANCE} of minifer's int4 "
             f"engine's", close_logprobs)]


def check_quant_in_engine(name: str, piece: Any) -> None:
    """Save ``piece`` (one of exercise 05's), grade it, and serve the int4 batch with it in the engine (minifer's
    other two pieces around it)."""
    notebook = workbench_quant.QUANT_PIECES[name].notebook
    checks, hint = saved_and_graded(name, piece, workbench_quant.save_quant, notebook)
    checks += serve_checks(f"your {name}", lambda: {name: piece}, hint)
    run_checks(f"{name} in the int4 engine", checks)


def load_quant_pieces(solution: bool = False, path=None,
                      reasons: dict[str, str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """``grading.engine.load_pieces`` for exercise 05's pieces: the saved ones that pass their checks and where each
    comes from; a missing or failing one raises, or with ``solution=True`` stays minifer's (why, in ``reasons``)."""
    broken: dict[str, str] = {}
    saved = workbench_quant.load_quant(path, broken)
    return sort_saved(saved, broken, workbench_quant.QUANT_PIECES, solution, path, reasons)


_last: dict[str, dict[str, Any]] = {"pieces": {}, "origin": {}, "reasons": {}}  # the latest int4 check's, for the cells after it


def check_int4_engine(solution: bool = False) -> None:
    """Every saved piece of exercise 05 at once (``solution=True`` fills the missing ones with minifer's): the int4
    engine with your quantizer, your load step and your kernel serves the batch, as minifer's int4 engine does."""
    def loaded() -> None:
        _last["reasons"] = {}
        _last["pieces"], _last["origin"] = load_quant_pieces(solution, reasons=_last["reasons"])

    checks = [("every int4 piece is saved and passes its checks" if not solution else
               "the saved int4 pieces are graded; minifer's fill the gaps (solution=True)", loaded)]
    checks += serve_checks("your int4 pieces", lambda: _last["pieces"],
                           "run each piece's own `in the engine` check cell in 05_quantization to find the one that "
                           "differs")
    run_checks("your int4 engine", checks)


def print_int4_origins() -> None:
    """Which int4 pieces the latest check ran were yours (not a check: it depends on what the folder holds)."""
    if not _last["origin"]:
        print("the int4 check has not loaded your pieces yet (run the cell above)")
    for name, where in _last["origin"].items():
        print(f"  {name:24} {where}")
        print_reason(_last["reasons"].get(name))


def int4_throughput(solution: bool = False, rounds: int = 1) -> float | None:
    """Output tokens/s of the int4 engine with the learner's pieces as a ratio of minifer's int4 engine's (printed,
    never asserted; under the interpreter the ratio says more about the interpreter than about the kernel)."""
    def measure() -> float:
        pieces = _last["pieces"] if _last["origin"] else load_quant_pieces(solution)[0]
        return interleaved_ratio(reference_int4_llm(), int4_engine(pieces), int4_tokens, rounds)

    return print_ratio("your int4 engine", measure, describe(), rounds, "minifer's int4 engine's")
