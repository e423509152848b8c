"""The engine core's size budget (issue 24): lines, modules and functions a learner has to read.

    python tools/count_lines.py            # the table, the over-budget modules and functions
    python tools/count_lines.py --json     # the same as JSON
    python tools/count_lines.py --features # the core's lines by feature, and the optional features outside it

A line counts when it is neither blank nor a comment; docstrings count (a learner reads them too). The core is
what a chapter's "code it teaches" points at, without the server and the course's machinery: ``config.py``,
``loader/``, ``models/``, ``layers/``, ``sampling.py``, ``engine/``, ``spec/``, ``quant/``, ``kernels/``. The budget:
at most 5,000 lines in all, no module over 400, no function over 60 (a Triton kernel, ``@triton.jit``, may be
longer: it is one GPU program and splitting it costs registers or launches). Optional features, which a run loads
only when it asks for them (``minifer/features/``: speculation's adaptive k and EAGLE, beam search, the CPU's
compilation switches, ...), are counted apart (``--features``). CUDA graphs (``engine/``) and the Triton quantized
matmul (``kernels/``) are core: every CUDA decode step and every quantized CUDA matmul runs them.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ["config.py", "loader", "models", "layers", "sampling.py", "engine", "spec", "quant", "kernels"]
BUDGET = {"total": 5000, "module": 400, "function": 60}
FEATURES_PACKAGE = "features"  # optional features outside the core: counted on their own (``--features``)
# The core's own features (paths under minifer/). Every other core module is the serving path a plain bf16 request
# takes (config, loader, model, layers, sampling, paging, scheduling, the engine step), which also carries each
# feature's few options and branches: a feature's count here is its modules, not every line it adds.
FEATURES = {
    "speculative decoding (fixed k: verify, n-gram, draft model)": [
        "spec/__init__.py", "spec/rejection.py", "spec/ngram.py", "spec/theory.py", "engine/proposers.py",
        "engine/speculative.py", "engine/spec_step.py"],
    "weight quantization (int8/int4/fp8 formats, QuantLinear, RTN, saved checkpoints)": [
        "quant/__init__.py", "quant/formats.py", "quant/linear.py", "quant/model.py", "loader/quantized.py",
        "loader/quant_fill.py"],
    "Triton paged-attention kernels (and their fp8 decoding)": ["kernels/__init__.py", "kernels/paged_attention.py",
                                                                "kernels/fp8.py"],
    "Triton dequantize-matmul of quantized weights (CUDA)": ["kernels/quant_matmul.py", "kernels/quant_matmul_jit.py"],
    "CUDA graphs of decode steps": ["engine/cuda_graph.py"],
    "8-bit KV cache (int8/fp8)": ["layers/kv_quant.py"],
    "static batching baseline": ["engine/static.py"],
}


def code_lines(source: str) -> set[int]:
    """Line numbers (1-based) that are neither blank nor comment-only."""
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                        tokenize.ENDMARKER):
            continue
        lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines


def _is_triton_kernel(fn: ast.AST) -> bool:
    return any("triton" in ast.unparse(d) and "jit" in ast.unparse(d) for d in fn.decorator_list)


def long_functions(source: str, lines: set[int], limit: int) -> list[tuple[str, int]]:
    """(qualified name, counted lines) of every function over ``limit`` lines, Triton kernels left out."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef) and not _is_triton_kernel(child):
                    start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                    n = len([i for i in range(start, child.end_lineno + 1) if i in lines])
                    if n > limit:
                        out.append((name, n))
                visit(child, name + ".")

    visit(ast.parse(source), "")
    return out


def core_files(root: Path = ROOT, entries: list[str] = CORE) -> list[Path]:
    pkg = root / "minifer"
    files = []
    for entry in entries:
        p = pkg / entry
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return files


def measure(root: Path = ROOT, entries: list[str] = CORE) -> dict:
    """Counted lines per core module (or per module of ``entries``), and what exceeds the budget."""
    modules, functions = {}, []
    for path in core_files(root, entries):
        source = path.read_text(encoding="utf-8")
        lines = code_lines(source)
        rel = path.relative_to(root).as_posix()
        modules[rel] = len(lines)
        functions += [(f"{rel}:{name}", n) for name, n in long_functions(source, lines, BUDGET["function"])]
    total = sum(modules.values())
    over_modules = {m: n for m, n in modules.items() if n > BUDGET["module"]}
    return {"total": total, "modules": modules, "over_modules": over_modules, "over_functions": dict(functions),
            "within_budget": total <= BUDGET["total"] and not over_modules and not functions}


def by_feature(modules: dict[str, int]) -> dict[str, int]:
    """Counted lines per entry of ``FEATURES``, and the rest as "serving path"; a listed module that is not in
    the core is an error (a renamed or moved module must be renamed here too)."""
    out, claimed = {}, set()
    for feature, paths in FEATURES.items():
        missing = [p for p in paths if f"minifer/{p}" not in modules]
        if missing:
            raise ValueError(f"FEATURES[{feature!r}] names modules that are not in the engine core: {missing}")
        claimed |= {f"minifer/{p}" for p in paths}
        out[feature] = sum(modules[f"minifer/{p}"] for p in paths)
    out["serving path (everything else)"] = sum(n for m, n in modules.items() if m not in claimed)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--features", action="store_true", help="the core's lines by feature")
    args = ap.parse_args(argv)
    m = measure()
    if args.features:
        for feature, n in sorted(by_feature(m["modules"]).items(), key=lambda kv: -kv[1]):
            print(f"{n:6d}  {feature}")
        print(f"{m['total']:6d}  engine core in all (budget {BUDGET['total']:,})")
        f = measure(entries=[FEATURES_PACKAGE])
        print(f"\noptional features outside the core (minifer/{FEATURES_PACKAGE}/, loaded only when a run asks):")
        for mod, n in sorted(f["modules"].items(), key=lambda kv: -kv[1]):
            print(f"{n:6d}  {mod}")
        print(f"{f['total']:6d}  features in all; core and features {m['total'] + f['total']:,}")
        return 0
    if args.json:
        print(json.dumps(m, indent=1))
        return 0
    for mod, n in sorted(m["modules"].items(), key=lambda kv: -kv[1]):
        print(f"{n:6d}  {mod}{'  (over ' + str(BUDGET['module']) + ')' if mod in m['over_modules'] else ''}")
    print(f"{m['total']:6d}  engine core in all (budget {BUDGET['total']:,})")
    for name, n in m["over_functions"].items():
        print(f"function over {BUDGET['function']} lines: {name} ({n})")
    print("within budget" if m["within_budget"] else "over budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
