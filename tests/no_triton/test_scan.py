"""``tools/no_triton/scan.py``: which notebooks and cells use Triton, read from their code (the no-Triton step's plan)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "no_triton"))
import scan  # noqa: E402


def uses(*cells: str) -> list[tuple[int, bool]]:
    """``(cell index, acts)`` for each cell of a notebook made of ``cells`` that uses Triton."""
    bound: set[str] = set()
    out = []
    for i, source in enumerate(cells):
        stmts = scan.triton_statements(ast.parse(source), bound)
        if stmts:
            out.append((i, not all(isinstance(s, scan.QUIET) for s in stmts)))
    return out


def test_triton_in_code_is_found_and_in_strings_or_comments_is_not():
    assert uses("import triton\n") == [(0, False)]
    assert uses("print(f\"Triton {env['triton']}\")  # triton\n") == []
    assert uses("triton_ok, msg = kvm.enable_triton_interpreter()\n", "if triton_ok:\n    pass\n") == [(0, False),
                                                                                                    (1, True)]


def test_what_a_triton_call_returns_and_a_kernel_wrapper_use_triton_and_a_pick_does_not():
    assert uses("tri = kvm.triton_vs_reference(seed=0)\n", "print(tri.message)\n") == [(0, False), (1, True)]
    wrapper = "def int4_matmul(x):\n    return kernel[(triton.cdiv(1, 2),)](x)\n"
    assert uses(wrapper, "check(int4_matmul)\n", "check(int4_matmul_torch)\n") == [(0, False), (1, True)]
    assert uses(wrapper, "mine = pick(int4_matmul, int4_matmul_torch)\n", "serve(mine)\n") == [(0, False), (1, False)]


def test_a_module_that_imports_triton_makes_its_importers_use_it():
    assert scan.module_uses_triton("minifer.kernels.quant_matmul_jit")
    assert not scan.module_uses_triton("minifer.kernels")  # the detection's own guarded import is not a use
    assert uses("from minifer.kernels import quant_matmul_jit as qm\n") == [(0, False)]


def test_the_plan_runs_the_chapters_that_use_triton_whole_and_an_exercise_through_its_twin():
    whole, first = scan.plan()
    names = {nb.rel for nb in whole}
    assert {"notebooks/02_kv_cache_and_paging.ipynb", "notebooks/05_quantization.ipynb",
            "solutions/05_quantization.ipynb"} <= names
    assert not any(n.startswith("exercises/") for n in names)
    assert ROOT / "notebooks" / "00_model_and_generation.ipynb" in first
    assert not {p for p in first} & {nb.path for nb in whole}
