"""The hosted notebooks' setup (Colab, Kaggle): what every notebook's first code cell calls after installing.

Every chapter and exercise notebook starts with a badge cell and a *setup cell* (both stamped by
``tools/stamp_hosted.py``). The setup cell is short on purpose: outside a clone it ``%pip install``s the package
itself with ``--no-deps`` (a hosted service's torch must not be replaced by a multi-GB download), then calls
``setup()`` here, which

* installs the course's other dependencies that are missing (``pip install`` with a constraints file that pins
  the torch and Triton already installed, so the resolver can never swap them), once: a second run finds them;
* says which torch it kept, and warns when it lies outside the range ``pyproject.toml`` was tested with;
* chooses the track (``choose_track``) and sets ``MINIFER_TRACK`` for the rest of the notebook: hosted with a GPU
  Triton supports, the GPU track (the Qwen3 pair from the Hub); on an older GPU (Kaggle's P100, sm_60: Triton
  compiles for compute capability 7.0 and later) or none, the CPU track, saying why.

Inside a clone it installs nothing and keeps the course's default track. Nothing here is imported at module level
beyond the standard library: the module runs before the course's dependencies are installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRACK_ENV = "MINIFER_TRACK"  # the same switch as minifer_course.common.TRACK_ENV (this module imports no torch)
TRITON_MIN_CAPABILITY = (7, 0)  # Triton's GPU compiler refuses older GPUs (Pascal: P100 sm_60, GTX 10xx sm_61)
KEPT = ("torch", "triton")  # what a hosted service preinstalled and must not be reinstalled
COURSE_EXTRA = "course"
# The ids of the two cells stamped above every notebook's own (tools/stamp_hosted.py): the badges and the setup
# cell. The tools that read a notebook's own cells (slides, the no-Triton step, the chapter-frame test) skip these.
BADGES_ID, SETUP_ID = "minifer-badges", "minifer-setup"
HOSTED_IDS = frozenset({BADGES_ID, SETUP_ID})


def _packaging():
    """``packaging`` (installed beside pip nearly everywhere; pip's vendored copy otherwise)."""
    try:
        from packaging import requirements, version
    except ImportError:  # pragma: no cover - a bare interpreter
        from pip._vendor.packaging import requirements, version  # type: ignore[no-redef]
    return requirements, version


def clone_root(module_file: str | Path) -> Path | None:
    """The clone ``minifer_course`` was imported from (a folder holding ``pyproject.toml`` beside the package), or
    None when it comes from an installed wheel (site-packages has no pyproject.toml)."""
    root = Path(module_file).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "minifer").is_dir() else None


def unmet_requirements(requires: list[str], extras: tuple[str, ...] = (COURSE_EXTRA,),
                       keep: tuple[str, ...] = KEPT) -> list[str]:
    """minifer's requirements (its metadata's ``Requires-Dist``, the course extra included) that this environment
    does not satisfy, leaving out ``keep``'s when installed at all: those are kept whatever their version."""
    requirements, version = _packaging()
    unmet = []
    for line in requires:
        req = requirements.Requirement(line)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            unmet.append(str(req).split(";")[0].strip())
            continue
        if req.name not in keep and not req.specifier.contains(version.Version(have).public, prereleases=True):
            unmet.append(str(req).split(";")[0].strip())
    return list(dict.fromkeys(unmet))


def pip_command(unmet: list[str], constraints: Path) -> list[str]:
    """The pip call that installs ``unmet``: quiet, and constrained to the torch and Triton already installed."""
    return [sys.executable, "-m", "pip", "install", "--quiet", "-c", str(constraints), *unmet]


def kept_pins(keep: tuple[str, ...] = KEPT) -> list[str]:
    """``name==version`` of each of ``keep`` that is installed: the constraints that leave them alone."""
    pins = []
    for name in keep:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return pins


def install_dependencies(requires: list[str], run=subprocess.check_call) -> list[str]:
    """Install what ``unmet_requirements`` finds missing (nothing on a second run); returns what it installed."""
    unmet = unmet_requirements(requires)
    if not unmet:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "kept.txt"
        constraints.write_text("\n".join(kept_pins()) + "\n")
        run(pip_command(unmet, constraints))
    importlib.invalidate_caches()
    return unmet


def torch_note(torch_version: str, requires: list[str]) -> str:
    """Which torch the notebook runs on, and a warning when it lies outside the range minifer was tested with."""
    requirements, version = _packaging()
    spec = next((requirements.Requirement(r).specifier for r in requires
                 if requirements.Requirement(r).name == "torch"), None)
    if spec is None or spec.contains(version.Version(torch_version).public, prereleases=True):
        return f"torch {torch_version} (kept; tested range {spec})"
    return (f"WARNING: torch {torch_version} lies outside the tested range {spec}: kept (reinstalling it would "
            f"download several GB); the course may still run, but its outputs were made inside that range")


def choose_track(env_track: str | None, capability: tuple[int, int] | None, hosted: bool,
                 dtype: str | None = None, gpu_name: str = "GPU") -> tuple[str, str]:
    """``("gpu" | "cpu", why)``: the track a notebook runs. ``MINIFER_TRACK`` wins when set, except that the GPU
    track needs a GPU Triton supports (its kernels run the paged attention there). Unset, a hosted notebook with
    such a GPU takes the GPU track (what a Colab T4 is for), a clone the CPU track (the stored outputs' track)."""
    asked = (env_track or "").strip().lower()
    if capability is None:
        return "cpu", "the CPU track (no CUDA GPU): the bundled TinyStories pair"
    cc = f"sm_{capability[0]}{capability[1]}"
    if tuple(capability) < TRITON_MIN_CAPABILITY:
        return "cpu", (f"the CPU track: this {gpu_name} is {cc}, and Triton compiles for compute capability "
                       f"{TRITON_MIN_CAPABILITY[0]}.{TRITON_MIN_CAPABILITY[1]} and later only (the GPU track's "
                       f"kernels need it): the bundled TinyStories pair on the CPU")
    if asked == "gpu" or (hosted and asked == ""):
        return "gpu", (f"the GPU track on this {gpu_name} ({cc}, {dtype or 'dtype auto'}): Qwen3-1.7B with "
                       f"Qwen3-0.6B as draft, from the Hugging Face Hub ({TRACK_ENV}=cpu for the CPU track)")
    return "cpu", f"the CPU track: the bundled TinyStories pair ({TRACK_ENV}=gpu for the GPU track on this {cc})"


def _gpu() -> tuple[tuple[int, int] | None, str | None, str]:
    """This machine's CUDA capability, ``dtype="auto"``'s dtype there and its name (None, None, "" without one)."""
    import torch

    if not torch.cuda.is_available():
        return None, None, ""
    from minifer.config import auto_dtype

    device = torch.device("cuda")
    return (tuple(torch.cuda.get_device_capability(device)), str(auto_dtype(device)).replace("torch.", ""),
            torch.cuda.get_device_name(device))


def setup(since: float | None = None, env: dict | None = None) -> str:
    """The setup cell's work after the package is importable; returns the track chosen (also set in ``env``)."""
    env = os.environ if env is None else env
    import minifer_course

    clone = clone_root(minifer_course.__file__)
    try:
        requires = metadata.requires("minifer") or []
    except metadata.PackageNotFoundError:  # a clone on sys.path that was never installed
        requires = []
    if clone is not None:
        print("minifer: using this clone of the repository, nothing to install" +
              ("" if requires else "; it is not installed: `make course` (README) installs its dependencies"))
    else:
        installed = install_dependencies(requires)
        took = f" (this cell took {time.perf_counter() - since:.0f} s)" if since is not None else ""
        print(f"minifer {metadata.version('minifer')} is installed" +
              (f", with {', '.join(installed)}" if installed else "") + took)
    import torch

    if clone is None:
        print(torch_note(torch.__version__, requires))
    capability, dtype, name = _gpu()
    track, why = choose_track(env.get(TRACK_ENV), capability, hosted=clone is None, dtype=dtype, gpu_name=name)
    if clone is None or (env.get(TRACK_ENV, "").lower() == "gpu" and track == "cpu"):
        env[TRACK_ENV] = track
    print(f"track: {why}")
    return track
