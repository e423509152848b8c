"""The hosted setup cell, run as Colab or Kaggle would run it: outside a clone, in a fresh environment.

The checkout is built as a wheel; a fresh venv sees this environment's packages (torch among them: a hosted
service's preinstalled torch) but not minifer, whose editable install's ``.pth`` hook a plain path entry does not
run. The cell's own text (``tools/stamp_hosted.py``'s template) then runs there, in a folder outside any clone,
with IPython's ``%pip`` replaced by the same pip call against the wheel instead of the git tag, offline. No GPU
here: the track it prints is the CPU one.
"""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import stamp_hosted  # noqa: E402

DRIVER = r'''
import json, shlex, subprocess, sys
from IPython.core.inputtransformer2 import TransformerManager

cell, requirement, wheel = sys.argv[1], sys.argv[2], sys.argv[3]
calls = []

class FakeIPython:
    """``%pip`` as IPython runs it (``python -m pip`` of this interpreter), the tag's URL replaced by the wheel."""
    def run_line_magic(self, name, line):
        assert name == "pip", name
        args = [wheel if a == requirement else a for a in shlex.split(line)]
        calls.append(args)
        subprocess.check_call([sys.executable, "-m", "pip", *args, "--no-index"])

code = TransformerManager().transform_cell(open(cell).read())
for run in (1, 2):
    print(f"--- run {run}", flush=True)
    exec(code, {"get_ipython": FakeIPython})
import torch, minifer_course, os
print("RESULT " + json.dumps({"calls": calls, "torch": torch.__file__, "course": minifer_course.__file__,
                              "track": os.environ.get("MINIFER_TRACK")}))
'''


def _build_wheel(tmp: Path) -> Path:
    """The checkout's package as a wheel (built from a copy, so no build/ or egg-info lands in the clone)."""
    src = tmp / "src"
    for name in ("minifer", "minifer_course"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "-w", str(tmp / "dist"), str(src)], check=True)
    return next((tmp / "dist").glob("minifer-*.whl"))


def _fresh_venv(tmp: Path) -> Path:
    """A venv whose path holds this environment's site-packages as plain entries: torch and the rest are there
    (not reinstalled), but no ``.pth`` of theirs runs, so an editable minifer stays out of sight."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                         capture_output=True, text=True).stdout.strip()
    parents = [p for p in (*site.getsitepackages(), site.getusersitepackages()) if Path(p).is_dir()]
    (Path(own) / "zz_parent_site.pth").write_text("\n".join(parents) + "\n")
    return python


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="the venv layout (bin/python) is POSIX's")
def test_the_setup_cell_installs_once_outside_a_clone_and_keeps_torch(tmp_path):
    wheel = _build_wheel(tmp_path)
    python = _fresh_venv(tmp_path)
    work = tmp_path / "Colab"  # outside any clone: no minifer_course/ above it
    work.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": "", "PIP_NO_INDEX": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}  # no PYTHONPATH: nothing of the clone's
    probe = "import importlib.util as u; print(u.find_spec('minifer_course') is None and u.find_spec('torch') is not None)"
    assert subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=env,
                          cwd=work).stdout.strip() == \
        "True", "the fresh venv must see torch but not minifer (is minifer installed non-editable here?)"
    cfg = stamp_hosted.read_config()
    (tmp_path / "cell.py").write_text(stamp_hosted.setup_cell(cfg).source)
    (tmp_path / "driver.py").write_text(DRIVER)
    proc = subprocess.run([str(python), str(tmp_path / "driver.py"), str(tmp_path / "cell.py"), cfg.requirement,
                           str(wheel)], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    result = json.loads(out.split("RESULT ", 1)[1])
    first, second = out.split("--- run 2")
    # installed once, quietly, without dependencies (torch untouched), from the release tag's requirement
    assert result["calls"] == [["install", "--quiet", "--no-deps", str(wheel)]]
    assert Path(result["course"]).is_relative_to(tmp_path / "venv"), result
    assert not Path(result["torch"]).is_relative_to(tmp_path / "venv"), "torch was reinstalled into the venv"
    assert not list((tmp_path / "venv").glob("lib/python*/site-packages/torch"))
    import torch

    assert f"torch {torch.__version__} (kept; tested range" in first, first
    assert "minifer 0.1.0 is installed (this cell took " in first and "using this clone" not in out
    assert "track: the CPU track (no CUDA GPU)" in first and result["track"] == "cpu"
    assert "is installed (this cell took" in second and ", with " not in second  # nothing left to install


def test_the_cell_uses_a_clone_and_installs_nothing(tmp_path, monkeypatch, capsys):
    """Inside a clone (this checkout, from one of its folders) the cell never reaches ``%pip``."""
    from IPython.core.inputtransformer2 import TransformerManager

    code = TransformerManager().transform_cell(stamp_hosted.setup_cell(stamp_hosted.read_config()).source)
    monkeypatch.chdir(ROOT / "notebooks")
    monkeypatch.delenv("MINIFER_TRACK", raising=False)

    def no_pip():
        raise AssertionError("a clone must not pip install")

    exec(code, {"get_ipython": no_pip})
    out = capsys.readouterr().out
    assert out.startswith("minifer: using this clone of the repository, nothing to install"), out
    assert "track: the CPU track" in out and "MINIFER_TRACK" not in __import__("os").environ
    assert textwrap.dedent(code).count("get_ipython().run_line_magic('pip'") == 1
