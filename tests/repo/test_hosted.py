"""Hosted notebooks (Colab, Kaggle): every notebook's badges and setup cell follow one repository URL, and the setup
cell's decisions (what to install, which torch to keep, which track) are right for the GPUs learners get.

No GPU here: CUDA's presence and compute capability are monkeypatched. The setup cell run end to end in a fresh
venv outside a clone is ``test_hosted_setup_cell.py``; the GPU track's memory plan by arithmetic is
``test_install_gpu_track.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest
import torch
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from minifer_course import common, hosted

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import build_exercises as bx  # noqa: E402
import stamp_hosted as sh  # noqa: E402

CFG = sh.read_config()
NOTEBOOKS = sh.targets()


# --- the stamped cells --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.relative_to(ROOT).as_posix() for p in NOTEBOOKS])
def test_every_notebook_carries_badges_and_the_setup_cell(path):
    """Badges that open this very notebook at the release tag of pyproject's Repository, then the setup cell of
    the template: `python3 tools/stamp_hosted.py` writes both (and `make exercises` for the exercises)."""
    rel = path.relative_to(ROOT).as_posix()
    nb = nbformat.read(path, as_version=4)
    assert sh.problems(nb, rel, CFG) == []
    assert f"colab.research.google.com/github/{CFG.slug}/blob/{CFG.tag}/{rel}" in nb.cells[0].source
    assert f"kaggle.com/kernels/welcome?src=https://github.com/{CFG.slug}/blob/{CFG.tag}/{rel}" in nb.cells[0].source
    assert f'%pip install --quiet --no-deps "minifer @ git+https://github.com/{CFG.slug}@{CFG.tag}"' in \
        nb.cells[1].source


def test_the_config_is_one_line_of_pyproject(tmp_path):
    """A fork changes [project.urls] Repository; the tag follows the version (`make release` tags v<version>)."""
    text = (ROOT / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(text.replace(CFG.repository, "https://github.com/someone/fork"))
    fork = sh.read_config(tmp_path / "pyproject.toml")
    assert (fork.slug, fork.tag) == ("someone/fork", CFG.tag) and CFG.tag.startswith("v")
    nb = sh.stamp(new_notebook(cells=[new_markdown_cell("# Title")]), "notebooks/x.ipynb", CFG)
    assert sh.problems(nb, "notebooks/x.ipynb", CFG) == []
    assert [p.split(": ", 1)[1][:26] for p in sh.problems(nb, "notebooks/x.ipynb", fork)] == \
        ["the minifer-badges cell di", "the minifer-setup cell dif"]
    assert "someone/fork@v" in sh.setup_cell(fork).source
    with pytest.raises(ValueError, match="must be https://github.com/OWNER/NAME"):
        _ = sh.Hosted("https://gitlab.com/a/b", "v1").slug


def test_stamping_twice_replaces_never_duplicates_and_keeps_the_setup_output():
    title, code = new_markdown_cell("# Title"), new_code_cell("x = 1")
    nb = sh.stamp(new_notebook(cells=[title, code]), "notebooks/x.ipynb", CFG)
    assert [c.id for c in nb.cells[:2]] == [sh.BADGES_ID, sh.SETUP_ID] and len(nb.cells) == 4
    nb.cells[1].outputs = [new_output("stream", name="stdout", text="minifer: using this clone\n")]
    nb.cells[1].execution_count = 1
    nb.cells[1].source = "stale"
    again = sh.stamp(nb, "notebooks/x.ipynb", CFG)
    assert len(again.cells) == 4 and again.cells[2].source == "# Title" and again.cells[3].source == "x = 1"
    assert again.cells[1].source == sh.setup_cell(CFG).source and again.cells[1].execution_count == 1
    assert again.cells[1].outputs[0]["text"] == "minifer: using this clone\n"
    moved = new_notebook(cells=[title, sh.setup_cell(CFG)])  # a setup cell moved down is found too
    assert sh.problems(moved, "n.ipynb", CFG)[0] == "n.ipynb: cell 0 is not the minifer-badges cell"
    assert len(sh.stamp(moved, "n.ipynb", CFG).cells) == 3


@pytest.mark.parametrize("ex", bx.discover()[:2], ids=lambda e: e.name)
def test_the_exercise_builder_emits_the_stamp_tools_cells(ex):
    """`build_exercises.py --check` and `stamp_hosted.py --check` agree: the builder's notebooks start with the
    cells the stamp tool writes, for each notebook's own path, and the source's cells keep their ids."""
    nbs = ex.notebooks()
    for variant, path in (("exercise", ex.exercise_path), ("solution", ex.solution_path)):
        rel = path.relative_to(ROOT).as_posix()
        assert sh.problems(nbs[variant], rel, CFG) == []
        assert nbs[variant].cells[2].id == "cell-00"


# --- the setup cell's decisions -----------------------------------------------------------------------


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA machine of a given compute capability whose Hub answers (``gpu(8, 0)``)."""
    from minifer.kernels import fp8, quant_matmul

    def make(major: int, minor: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
        monkeypatch.setattr(common, "hub_reachable", lambda timeout=2.0: True)
        for cached in (fp8.fp8_native, quant_matmul._turing, quant_matmul._one_dot):
            cached.cache_clear()

    yield make
    for cached in (fp8.fp8_native, quant_matmul._turing, quant_matmul._one_dot):
        cached.cache_clear()


# capability: (track hosted, dtype="auto", Turing configs for int4, one dot per K-step (wgmma), fp8 in hardware)
GPUS = {"sm_60 P100": ((6, 0), "cpu", torch.float16, True, False, False),
        "sm_75 T4": ((7, 5), "gpu", torch.float16, True, False, False),
        "sm_80 A100": ((8, 0), "gpu", torch.bfloat16, False, False, False),
        "sm_89 L4": ((8, 9), "gpu", torch.bfloat16, False, False, True),
        "sm_90 H100": ((9, 0), "gpu", torch.bfloat16, False, True, True)}


@pytest.mark.parametrize("name", GPUS)
def test_dtype_kernels_and_track_for_each_gpu_learners_get(name, gpu):
    from minifer.config import auto_dtype
    from minifer.kernels.fp8 import fp8_native
    from minifer.kernels.quant_matmul import _one_dot, _turing

    cc, track, dtype, turing, one_dot, fp8 = GPUS[name]
    gpu(*cc)
    cuda = torch.device("cuda")
    assert auto_dtype(cuda) == dtype  # float16 on the T4 (no bfloat16 hardware), bfloat16 from sm_80
    assert (_turing(cuda), _one_dot(cuda), fp8_native(cuda)) == (turing, one_dot, fp8)
    chosen, why = hosted.choose_track(None, cc, hosted=True, dtype=str(dtype).split(".")[1], gpu_name=name)
    assert chosen == track, why
    pair = common.choose_models({"MINIFER_TRACK": "gpu"})
    assert pair.device == ("cuda" if track == "gpu" else "cpu"), pair.reason
    if track == "cpu":  # the P100: said, and why
        assert "sm_60" in why and "Triton compiles for compute capability 7.0 and later" in why
        assert pair.target == common.BUNDLED_PAIR[0] and "Triton" in pair.reason
    else:
        assert f"sm_{cc[0]}{cc[1]}, {str(dtype).split('.')[1]}" in why and "Qwen3-1.7B" in why


def test_the_track_follows_the_switch_and_the_place():
    """Unset, hosted takes the GPU track a T4 is for, a clone keeps the CPU track its stored outputs show;
    MINIFER_TRACK wins either way; no GPU means the CPU track whatever was asked."""
    t4 = (7, 5)
    assert hosted.choose_track(None, t4, hosted=True)[0] == "gpu"
    assert hosted.choose_track(None, t4, hosted=False)[0] == "cpu"
    assert hosted.choose_track("cpu", t4, hosted=True)[0] == "cpu"
    assert hosted.choose_track("GPU", t4, hosted=False)[0] == "gpu"
    assert hosted.choose_track("gpu", None, hosted=True) == ("cpu", "the CPU track (no CUDA GPU): the bundled "
                                                                    "TinyStories pair")


def test_setup_sets_the_track_for_the_rest_of_the_notebook(gpu, monkeypatch, capsys):
    """In a clone on a P100 with MINIFER_TRACK=gpu the setup says why and switches to the CPU track; on a T4 in a
    clone it leaves the switch alone."""
    gpu(6, 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla P100-PCIE-16GB")
    env = {"MINIFER_TRACK": "gpu"}
    assert hosted.setup(env=env) == "cpu" and env["MINIFER_TRACK"] == "cpu"
    assert "this Tesla P100-PCIE-16GB is sm_60" in capsys.readouterr().out
    gpu(7, 5)
    env = {}
    assert hosted.setup(env=env) == "cpu" and env == {}


def test_only_what_is_missing_is_installed_and_torch_is_pinned(monkeypatch, tmp_path):
    """A hosted machine with an old torch and no fastapi: fastapi (and the course extra's missing piece) is
    installed, with the installed torch and Triton as constraints; torch itself is never in the command, even
    outside the tested range. Everything present: no pip call at all (the cell's second run)."""
    have = {"torch": "2.8.0+cu126", "triton": "3.4.0", "numpy": "2.0.2", "jupyterlab": "4.2.0"}

    def version(name):
        if name not in have:
            raise hosted.metadata.PackageNotFoundError(name)
        return have[name]

    monkeypatch.setattr(hosted.metadata, "version", version)
    requires = ["torch>=2.12,<2.16", "numpy>=1.26", "fastapi>=0.115", "triton>=3.7; sys_platform == 'linux'",
                "jupyterlab>=4.2; extra == 'course'", "matplotlib>=3.8; extra == 'course'",
                "nbval>=0.11; extra == 'dev'"]
    calls = []

    def run(cmd):
        calls.append((cmd, Path(cmd[cmd.index("-c") + 1]).read_text().split()))

    installed = hosted.install_dependencies(requires, run=run)
    assert installed == ["fastapi>=0.115", "matplotlib>=3.8"]
    [(cmd, pins)] = calls
    assert cmd[1:5] == ["-m", "pip", "install", "--quiet"] and cmd[-2:] == installed
    assert pins == ["torch==2.8.0+cu126", "triton==3.4.0"]
    have.update(fastapi="0.115.0", matplotlib="3.9.0")
    assert hosted.install_dependencies(requires, run=run) == [] and len(calls) == 1
    assert hosted.torch_note("2.8.0+cu126", requires).startswith("WARNING: torch 2.8.0+cu126 lies outside the "
                                                                 "tested range <2.16,>=2.12: kept")
    assert hosted.torch_note("2.13.0+cpu", requires) == "torch 2.13.0+cpu (kept; tested range <2.16,>=2.12)"


def test_an_installed_package_is_not_a_clone(tmp_path):
    (tmp_path / "site-packages" / "minifer_course").mkdir(parents=True)
    assert hosted.clone_root(tmp_path / "site-packages" / "minifer_course" / "__init__.py") is None
    assert hosted.clone_root(ROOT / "minifer_course" / "__init__.py") == ROOT
