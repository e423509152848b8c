"""tools/count_lines.py: the counting rules on small sources, and the engine against its size measures (issue 45):
the package without its benchmarks, the decode path, long functions, and the files one decode step enters.

Each measure has a ceiling, today's size: a change that grows past it fails here, naming the measure (lower the
ceiling when code leaves). The targets the design aims at are printed beside them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("count_lines", ROOT / "tools" / "count_lines.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SOURCE = '''"""A docstring
of two lines."""

# a comment


def short():
    return 1  # trailing comment: the line counts


@triton.jit
def kernel():
''' + "    x = 1\n" * 70 + '''

def long():
''' + "    x = 1\n" * 51


def test_blank_and_comment_lines_do_not_count_and_docstrings_do():
    cl = _tool()
    lines = cl.code_lines(SOURCE)
    assert {1, 2} <= lines and 3 not in lines and 4 not in lines  # the docstring's two lines, not blank/comment
    assert 7 in lines and 8 in lines and 9 not in lines


def test_long_functions_are_found_and_triton_kernels_are_exempt():
    cl = _tool()
    found = cl.long_functions(SOURCE, cl.code_lines(SOURCE), cl.FUNCTION)
    assert found == [("long", 52)]  # its def line and 51 statements; the 71-line kernel is not reported


def test_the_decode_path_leaves_out_speculation_and_the_package_its_benchmarks():
    cl = _tool()
    assert cl.in_decode_path("core/sched/scheduler.py") and cl.in_decode_path("attention/backends/paged.py")
    assert not cl.in_decode_path("engine/speculative.py") and not cl.in_decode_path("kernels/quant_matmul.py")
    assert not cl.in_decode_path("engine/arg_utils.py")  # the options, read at start-up (the trace never enters it)
    m = cl.measure(ROOT)
    assert not any(rel.startswith("bench/") for rel in m["modules"])
    assert m["package"] == sum(m["modules"].values()) > m["decode_path"] > 0


def test_the_engine_within_its_ceilings():
    cl = _tool()
    m = cl.measure(ROOT)
    over = {k: (m[k], cl.CEILING[k]) for k in cl.CEILING if m[k] > cl.CEILING[k]}
    assert not over, (f"grew past today's size (measured, ceiling): {over}; targets {cl.TARGET}; functions over "
                      f"{cl.FUNCTION} lines: {m['functions_over_limit']}")


def test_a_plain_decode_step_enters_few_files():
    files = _tool().trace_step()
    assert {"engine/llm_engine.py", "core/sched/scheduler.py", "worker/model_runner.py", "models/llama.py",
            "attention/backends/paged.py", "sample/sampler.py"} <= set(files), sorted(files)
    assert len(files) <= _tool().STEP_FILES["ceiling"], sorted(files)
