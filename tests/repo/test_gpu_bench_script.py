"""scripts/gpu_bench.py, the prepared GPU check, on the CPU: a section cut short by its time limit (here: an
error in its third run) still leaves the rows it finished, marked partial; and gpu_check.sh's selections of
native kernel tests."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_bench.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quant_e2e_saves_each_finished_row(tmp_path, monkeypatch):
    gb = _load()
    real_llm, made = gb.LLM, []

    def llm(*a, **kw):
        made.append(kw.get("quantization"))
        if len(made) == 3:
            raise RuntimeError("stopped here, as a time limit would")
        return real_llm(*a, **kw)

    monkeypatch.setattr(gb, "LLM", llm)
    out = tmp_path / "quant_e2e.json"
    args = argparse.Namespace(smoke=True, device="cpu", out=out, section="quant_e2e")
    with pytest.raises(RuntimeError, match="stopped here"):
        gb.section_quant_e2e(args)
    partial = json.loads(out.read_text())
    assert partial["partial"] is True
    assert [r["quantization"] for r in partial["rows"]] == ["bf16", "int8"]
    assert all(r["decode_tokens_per_s"] > 0 for r in partial["rows"])


def test_quant_e2e_reports_every_format_and_the_target(tmp_path):
    gb = _load()
    args = argparse.Namespace(smoke=True, device="cpu", out=tmp_path / "quant_e2e.json", section="quant_e2e")
    report = gb.section_quant_e2e(args)
    assert [r["quantization"] for r in report["rows"]] == ["bf16", "int8", "int4", "fp8"]
    assert report["rows"][0]["speedup_vs_bf16"] == 1.0
    t = report["target"]
    assert t["measured"] == report["rows"][2]["speedup_vs_bf16"] and t["met"] is (t["measured"] >= 1.8)


def _collected(files: list[str], expr: str) -> set[str]:
    import subprocess
    import sys

    root = SCRIPT.parents[1]
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly", *files,
                        *(["-k", expr] if expr else [])], capture_output=True, text=True, cwd=root)
    return {line for line in r.stdout.splitlines() if "::" in line}


def test_gpu_check_kernel_test_selections_cover_every_native_test_once():
    """gpu_check.sh splits the kernel tests in two ``-k`` selections (int4's first); a typo there would run
    nothing on a lent GPU and say so only in its log. Together they must be every test of the two files but
    the ahead-of-time compiles (CPU CI's), each once."""
    import re
    import shlex

    text = (SCRIPT.parent / "gpu_check.sh").read_text().replace("\\\n", " ")
    runs = [shlex.split(line) for line in text.splitlines() if "kernel-tests $tests" in line]
    assert len(runs) == 2, runs
    selections = []
    for words in runs:
        files = [w for w in words if w.startswith("tests/")]
        selections.append(_collected(files, words[words.index("-k") + 1]))
    everything = _collected(["tests/kernels/test_quant_kernels.py", "tests/kernels/test_kernels.py"], "")
    aot = {t for t in everything if re.search(r"ahead_of_time", t)}
    assert selections[0] and selections[1] and aot
    assert not selections[0] & selections[1]
    assert selections[0] | selections[1] == everything - aot
    assert all("int4" in t for t in selections[0])


def test_quant_graphs_runs_each_format_on_the_cpu(tmp_path):
    """On the CPU there are no graphs (and the quantized layers take the PyTorch path): the section still
    runs each format eagerly twice and finds the same tokens, so its plumbing is checked before a GPU has it."""
    gb = _load()
    out = tmp_path / "quant_graphs.json"
    report = gb.section_quant_graphs(argparse.Namespace(device="cpu", out=out, section="quant_graphs", smoke=True))
    assert [r["variant"] for r in report["rows"]] == ["int4", "int8", "fp8", "kv int8", "kv fp8", "kv int8 static"]
    assert all(r["identical"] and r["identical_after_growth"] and not r["cuda_graphs"] for r in report["rows"])
    assert json.loads(out.read_text())["partial"] is True  # saved after each format
