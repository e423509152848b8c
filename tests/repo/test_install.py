"""The install routes as files: pyproject's ranges, CI's constraints, the Makefile, environment.yml, the
wheelhouse script, and what dtype='auto' picks on each GPU generation. (Installing for real takes minutes
and a network: docs/install.md records which routes were run and how.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import pin_constraints  # noqa: E402

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None


def pyproject() -> dict:
    if tomllib is None:
        pytest.skip("tomllib arrived in Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def pins() -> dict[str, str]:
    lines = (ROOT / "constraints" / "ci.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


# --- dtype="auto" ------------------------------------------------------------------------------------


@pytest.mark.parametrize("capability,want", [((7, 0), torch.float16), ((7, 5), torch.float16),
                                             ((8, 0), torch.bfloat16), ((8, 9), torch.bfloat16),
                                             ((9, 0), torch.bfloat16), ((12, 0), torch.bfloat16)])
def test_auto_dtype_is_float16_below_compute_capability_8(monkeypatch, capability, want):
    """V100 and T4 have no bfloat16 arithmetic: 'auto' gives them float16; A100, L4, H100 and newer bfloat16."""
    from minifer.config import auto_dtype
    from minifer.entrypoints.llm import resolve_dtype

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert auto_dtype(torch.device("cuda")) is want
    assert resolve_dtype("auto", torch.device("cuda")) is want
    assert resolve_dtype("bfloat16", torch.device("cuda")) is torch.bfloat16  # an explicit choice is kept
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32


# --- pyproject and CI's constraints ------------------------------------------------------------------


def test_torch_floats_in_a_range_and_ci_pins_a_point_inside_it():
    deps = [Requirement(d) for d in pyproject()["project"]["dependencies"]]
    torch_req = next(r for r in deps if r.name == "torch")
    assert not any(s.operator == "==" for s in torch_req.specifier), "torch is pinned exactly again"
    assert pins()["torch"] == "2.13.0" and "2.13.0" in torch_req.specifier
    assert all(torch_req.specifier.contains(v) for v in ("2.12.1", "2.14.1", "2.15.0"))  # the releases run
    assert not torch_req.specifier.contains("2.11.0") and not torch_req.specifier.contains("2.16.0")


def test_constraints_pin_every_dependency_inside_its_range():
    """Every requirement of minifer[course,dev] (for Linux, where CI runs) has a pin, and the pin satisfies it:
    a range moved in pyproject.toml without re-pinning fails here."""
    project = pyproject()["project"]
    reqs = [Requirement(d) for d in project["dependencies"]]
    reqs += [Requirement(d) for extra in ("course", "dev") for d in project["optional-dependencies"][extra]]
    env = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux"}
    pinned = pins()
    for r in reqs:
        if r.marker is not None and not r.marker.evaluate(env):
            continue
        name = pin_constraints.canonicalize_name(r.name)
        assert name in pinned, f"{r.name} is not pinned in constraints/ci.txt"
        assert r.specifier.contains(pinned[name], prereleases=True), f"{name}=={pinned[name]} is outside {r}"


def test_the_course_extra_holds_no_test_tools():
    extras = pyproject()["project"]["optional-dependencies"]
    course = {Requirement(d).name for d in extras["course"]}
    assert "jupyterlab" in course and not course & {"pytest", "nbval", "pytest-xdist", "hypothesis"}
    assert {"pytest", "nbval"} <= {Requirement(d).name for d in extras["dev"]}


def test_pin_constraints_walks_extras_and_markers():
    """The closure follows each requirement's extras and evaluates markers, and drops local version labels."""

    class Dist:
        def __init__(self, version, requires):
            self.version, self.requires = version, requires

    dists = {"minifer": Dist("0.1.0", ["torch>=2", 'jupyterlab; extra == "course"', 'pytest; extra == "dev"',
                                       'pywin32; sys_platform == "win32" and extra == "course"']),
             "torch": Dist("2.13.0+cpu", ["filelock", 'triton; extra == "gpu"']),
             "jupyterlab": Dist("4.6.6", ["httpx[http2]"]), "httpx": Dist("0.28.1", ['h2; extra == "http2"']),
             "h2": Dist("4.3.0", []), "filelock": Dist("3.0", []), "pytest": Dist("9.0", []), "pywin32": Dist("311", [])}
    want = {"torch": "2.13.0", "jupyterlab": "4.6.6", "httpx": "0.28.1", "h2": "4.3.0", "filelock": "3.0"}
    got = pin_constraints.closure(extras=("course",), distribution=dists.__getitem__)
    if sys.platform == "win32":  # pragma: no cover - the marker holds there
        want["pywin32"] = "311"
    assert got == want


# --- Makefile, .ci/run, environment.yml ---------------------------------------------------------------


def make_n(*args: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    # Run as from a shell, not as a sub-make of `make test`: a parent make passes its command-line variables
    # (CI's CONSTRAINTS and TORCH_INDEX) down through MAKEFLAGS and the environment.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "CONSTRAINTS",
                                                             "TORCH_INDEX")}
    return subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, check=True,
                          env=env).stdout


def test_make_course_installs_the_course_only_and_serves_the_repository_root():
    out = make_n("course", "TORCH_INDEX=https://download.pytorch.org/whl/cpu")
    torch_spec = next(d for d in pyproject()["project"]["dependencies"] if d.startswith("torch"))
    assert f'"{torch_spec}" --index-url https://download.pytorch.org/whl/cpu' in out  # the CPU build first
    assert '-e ".[course]"' in out and "dev]" not in out
    lab = next(line for line in out.splitlines() if "jupyter lab" in line)
    assert "--ServerApp.root_dir=. notebooks/00_model_and_generation.ipynb" in lab


def test_ci_installs_exactly_the_constraints_and_asks_no_other_index():
    out = make_n("test", "CONSTRAINTS=constraints/ci.txt", "TORCH_INDEX=")
    assert "--index-url" not in out and '-c constraints/ci.txt -e ".[course,dev]"' in out
    assert re.search(r"^make test CONSTRAINTS=constraints/ci.txt TORCH_INDEX=$", (ROOT / ".ci" / "run").read_text(),
                     re.M)


def test_environment_yml_is_the_cpu_route_for_the_course():
    import yaml

    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python="))
    assert pyproject()["project"]["requires-python"] == ">=3.10" and python.split("=")[1] >= "3.10"
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert pip == ["--extra-index-url https://download.pytorch.org/whl/cpu", '-e ".[course]"']


def test_wheelhouse_script_downloads_torch_from_the_cpu_index_then_the_rest(tmp_path):
    """The script's steps, with a stand-in python that records each pip call (the real run, minutes long,
    is recorded in README): torch from the CPU index without dependencies, then the course pinned to that
    torch, plus setuptools for the offline editable install."""
    log = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/sh
echo "$@" >> {log}
case "$*" in *--no-deps*) for a; do [ "$prev" = --dest ] && touch "$a/torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl"; prev=$a; done;; esac
""")
    fake.chmod(0o755)
    out = tmp_path / "wh"
    r = subprocess.run(["bash", str(ROOT / "scripts" / "build_wheelhouse.sh"), str(out)], cwd=tmp_path,
                       env={**{k: v for k, v in os.environ.items() if k != "TORCH_INDEX"}, "PY": str(fake)},
                       capture_output=True, text=True)  # the script's default index (make exports TORCH_INDEX)
    assert r.returncode == 0, r.stderr
    first, second = log.read_text().splitlines()
    torch_spec = next(d for d in pyproject()["project"]["dependencies"] if d.startswith("torch"))
    assert first.endswith(f"--no-deps --dest {out} {torch_spec} --index-url https://download.pytorch.org/whl/cpu")
    assert f"--find-links {out}" in second and ".[course] setuptools>=69 wheel" in second
    assert "torch 2.13.0+cpu" in r.stdout


def test_make_test_ends_with_the_course_without_triton():
    """Its last step runs the notebooks with tools/no_triton's shim on every process's path (Jupyter kernels start
    in the notebooks' folder, so the path is absolute), and refuses to pass by skipping."""
    last = make_n("test", "CONSTRAINTS=constraints/ci.txt", "TORCH_INDEX=").strip().splitlines()[-1]
    assert f"PYTHONPATH={ROOT}/tools/no_triton " in last and "MINIFER_NO_TRITON_STEP=1" in last
    assert last.endswith("tests/no_triton/test_notebooks_without_triton.py")
