"""The engine's size, by the measures that show its design (issue 45): what a learner has to read.

    python tools/count_lines.py          # the table: the package, the decode path, long functions
    python tools/count_lines.py --json   # the same as JSON

A line counts when it is neither blank nor a comment; docstrings count (a learner reads them too).

- **package**: the installed engine, ``minifer/`` without ``minifer/bench`` (the benchmarks a user runs against
  any engine); kernels, loader, server and entrypoints included. The course's graders, helpers and experiments
  live in ``minifer_course/`` and are not counted.
- **decode path**: what a plain decode step is made of: the engine (``minifer/engine/`` without speculative
  decoding's modules), the model, the layers (attention included) and sampling.
- **long functions**: functions of the package over ``FUNCTION`` lines; a Triton kernel (``@triton.jit``) is
  exempt: it is one GPU program, and splitting it costs registers or launches.

``TARGET`` is where the design should land; ``CEILING`` is the size today, which a change may not exceed
(``tests/repo/test_size_budget.py``): lower it when code leaves, never raise it to let code in.
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
FUNCTION = 50
# modules inside the decode path's folders that a plain decode step never runs (speculation, adaptive k, EAGLE's
# head, data-parallel replicas)
SPECULATIVE = ("engine/speculative.py", "engine/spec_step.py", "engine/adaptive_k.py", "engine/data_parallel.py",
               "models/llama_eagle.py")
DECODE_PATH = ("engine", "core", "worker", "models", "layers", "attention", "sample/sampler.py", "sampling_params.py",
               "request.py", "quantization/kv_cache.py")
# the engine's options, read once when an LLM is built (vLLM keeps them outside v1's engine too): no step enters them
START_UP = ("engine/arg_utils.py",)
TARGET = {"package": 8000, "decode_path": 3200, "long_functions": 0}
CEILING = {"package": 9903, "decode_path": 2551, "long_functions": 0}
STEP_FILES = {"target": 10, "ceiling": 13}  # distinct minifer/ files one plain decode step enters (vLLM's split:
# sampling_params.py apart from sample/sampler.py, core/block_pool.py under core/kv_cache_manager.py)


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


def package_modules(root: Path = ROOT) -> dict[str, str]:
    """``{path relative to minifer/: source}`` of the installed engine, ``minifer/bench`` left out."""
    pkg = root / "minifer"
    return {p.relative_to(pkg).as_posix(): p.read_text(encoding="utf-8")
            for p in sorted(pkg.rglob("*.py")) if p.relative_to(pkg).parts[0] != "bench"}


def in_decode_path(rel: str) -> bool:
    return rel not in SPECULATIVE + START_UP and any(rel == e or rel.startswith(e + "/") for e in DECODE_PATH)


def measure(root: Path = ROOT) -> dict:
    modules, long = {}, {}
    for rel, source in package_modules(root).items():
        lines = code_lines(source)
        modules[rel] = len(lines)
        long.update({f"{rel}:{name}": n for name, n in long_functions(source, lines, FUNCTION)})
    return {"package": sum(modules.values()),
            "decode_path": sum(n for rel, n in modules.items() if in_decode_path(rel)),
            "long_functions": len(long), "modules": modules, "functions_over_limit": long}


def trace_step(speculative_config: dict | None = None) -> dict[str, list[str]]:
    """The ``minifer/`` functions one steady-state ``LLMEngine.step()`` of the bundled target enters, by file: four
    greedy requests, eight steps first (prefill done, the step's shapes settled), then one step under
    ``sys.setprofile``. A count of code, not of time: the same on every machine."""
    import minifer
    from minifer import LLM, SamplingParams

    root = Path(minifer.__file__).parent
    llm = LLM("tinystories-target", speculative_config=speculative_config)
    engine = llm.engine
    prompt = "Once upon a time there was a cat. The cat was happy. The cat was happy. The cat"
    for i in range(4):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    for _ in range(8):
        engine.step()
    entered: dict[str, set[str]] = {}

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(str(root)):
            entered.setdefault(Path(path).relative_to(root).as_posix(), set()).add(frame.f_code.co_qualname)

    sys.setprofile(profile)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
    return {f: sorted(names) for f, names in sorted(entered.items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--trace", choices=["plain", "ngram"], help="the files and functions one decode step enters")
    args = ap.parse_args(argv)
    if args.trace:
        spec = {"method": "ngram", "num_speculative_tokens": 4} if args.trace == "ngram" else None
        files = trace_step(spec)
        for f, names in files.items():
            print(f"minifer/{f}: {', '.join(names)}")
        print(f"{len(files)} files, {sum(map(len, files.values()))} functions")
        return 0
    m = measure()
    if args.json:
        print(json.dumps(m, indent=1))
        return 0
    for rel, n in sorted(m["modules"].items(), key=lambda kv: -kv[1]):
        print(f"{n:6d}  minifer/{rel}{'  (decode path)' if in_decode_path(rel) else ''}")
    for key in TARGET:
        print(f"{key}: {m[key]:,} (target {TARGET[key]:,})")
    for name, n in m["functions_over_limit"].items():
        print(f"  function over {FUNCTION} lines: minifer/{name} ({n})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
