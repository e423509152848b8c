"""``python -m minifer_course.doctor``: is this installation ready for the course?

Prints versions, the compute device, whether Triton can run kernels (GPU, or the CPU interpreter) and
compile them ahead of time for the GPUs learners have (sm_75 T4, sm_80 A100, sm_89 L4, sm_90 H100/H200),
whether the bundled models load and generate, and whether a model hub is reachable. Then the install
route: a torch outside the tested range, a CUDA build of torch on a machine without a GPU (gigabytes of
NVIDIA libraries for nothing: docs/install.md's CPU route avoids them), a missing course extra, which track the
notebooks will run and what the GPU track would download. Exit code 0 when everything the CPU track needs
works; warnings do not change it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import subprocess
import sys
import time


def _version(mod: str) -> str:
    try:
        return getattr(importlib.import_module(mod), "__version__", "installed")
    except Exception as e:  # noqa: BLE001 - report any import failure as text
        return f"missing ({type(e).__name__})"


_KERNEL = r"""
import torch, triton, triton.language as tl
@triton.jit
def add(x, y, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out + i, tl.load(x + i, mask=m) + tl.load(y + i, mask=m), mask=m)
"""
_INTERP = _KERNEL + r"""
a = torch.arange(10.0); b = torch.ones(10); o = torch.empty(10)
add[(1,)](a, b, o, 10, BLOCK=16)
print("interp=" + str(bool(torch.equal(o, a + 1))))
"""
_AOT = _KERNEL + r"""
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
sig = {"x": "*fp32", "y": "*fp32", "out": "*fp32", "n": "i32", "BLOCK": "constexpr"}
for cc in (75, 80, 89, 90):
    try:
        k = triton.compile(ASTSource(fn=add, signature=sig, constexprs={"BLOCK": 16}), target=GPUTarget("cuda", cc, 32))
        print(f"sm_{cc}=" + ("ok" if "ptx" in k.asm and "cubin" in k.asm else "no cubin"))
    except Exception as e:
        print(f"sm_{cc}=FAILED {type(e).__name__}: {str(e)[:80]}")
"""


def _run(code: str, interpret: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"  # must be set before triton is imported, hence a subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # @triton.jit needs its source in a real file
        script = os.path.join(tmp, "triton_check.py")
        with open(script, "w") as f:
            f.write(code)
        try:
            r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300, env=env)
        except Exception as e:  # noqa: BLE001
            return {"error": f"{type(e).__name__}: {e}"}
    out = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    if not out:
        out["error"] = (r.stderr.strip().splitlines() or ["no output"])[-1]
    return out


def _triton_status() -> tuple[str, str]:
    """Triton kernels on CPU tensors (interpreter) and compiled ahead of time for sm_75/80/89/90 (no GPU needed)."""
    interp = _run(_INTERP, interpret=True)
    aot = _run(_AOT, interpret=False)
    interp_s = "ok" if interp.get("interp") == "True" else f"FAILED {interp}"
    aot_s = ", ".join(f"{k}: {v}" for k, v in aot.items())
    return interp_s, aot_s


def _hub_reachable() -> str:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return "offline (HF_HUB_OFFLINE=1)"
    try:
        import socket

        socket.create_connection(("huggingface.co", 443), timeout=3).close()
        return "reachable"
    except OSError:
        return "not reachable: the course uses the bundled tinystories models"


CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def torch_requirement() -> str | None:
    """The torch range minifer was installed with (its metadata: pyproject.toml at install time)."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        reqs = requires("minifer") or []
    except PackageNotFoundError:
        return None
    return next((r.split(";")[0].strip() for r in reqs if r.replace(" ", "").startswith("torch") and
                 not r.startswith("torchvision")), None)


def install_checks(torch_version: str, cuda_build: str | None, gpu_capability: tuple[int, int] | None,
                   gpu_memory_bytes: int | None, system: str, track: str | None, requirement: str | None,
                   have_jupyterlab: bool, have_triton: bool) -> list[tuple[str, str, str]]:
    """The install route's checks, as ``(name, "ok" | "warn" | "fail", message)`` rows. Pure: everything
    it looks at is an argument, so each case is tested without the hardware it describes."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    rows: list[tuple[str, str, str]] = []
    if requirement:
        spec = Requirement(requirement).specifier
        inside = Version(Version(torch_version).public) in spec
        rows.append(("torch range", "ok" if inside else "warn",
                     f"{torch_version} is in {spec} (tested)" if inside else
                     f"{torch_version} is outside the tested range {spec}: the course may still run, but its "
                     "outputs were made with a version inside it"))
    build = f"CUDA {cuda_build} build" if cuda_build else "CPU build"
    if cuda_build and gpu_capability is None:
        rows.append(("torch build", "warn",
                     f"{build}, but no CUDA GPU is visible: its NVIDIA libraries (several GB) go unused. The CPU "
                     f"route installs the CPU build: pip install --force-reinstall torch --index-url {CPU_INDEX}"))
    else:
        rows.append(("torch build", "ok", build))
    if gpu_capability is not None:
        major, minor = gpu_capability
        cc = f"sm_{major}{minor}"
        dtype = "bfloat16" if major >= 8 else "float16 (no bfloat16 below compute capability 8.0)"
        rows.append(("GPU dtype", "ok", f"{cc}: dtype='auto' runs in {dtype}"))
        if major * 10 + minor not in (75, 80, 86, 89, 90):
            rows.append(("GPU kernels", "warn", f"{cc} is not one of the architectures CI compiles the Triton "
                                                "kernels for (sm_75, sm_80, sm_89, sm_90): they will JIT-compile "
                                                "but nobody has checked them for spills there"))
        if gpu_memory_bytes is not None:
            from minifer_course.gpu_plan import GPU_TRACK_NEEDS_BYTES

            gb = gpu_memory_bytes / 2**30
            need = GPU_TRACK_NEEDS_BYTES / 2**30
            rows.append(("GPU memory", "ok" if gb >= need else "warn",
                         f"{gb:.1f} GiB; the GPU track's largest chapter needs {need:.1f} GiB (its KV caches "
                         f"then take the rest)" +
                         ("" if gb >= need else ": stay on the CPU track, or set MINIFER_TARGET to a smaller model")))
    if system == "Linux" and not have_triton:
        rows.append(("triton", "fail", "missing on Linux: pip install -e . installs it (the kernels' chapters need it)"))
    elif not have_triton:
        rows.append(("triton", "ok", f"no wheels for {system}: the Triton cells skip and say why; the CPU path runs"))
    rows.append(("course extra", "ok" if have_jupyterlab else "warn",
                 "jupyterlab installed" if have_jupyterlab else 'jupyterlab missing: pip install -e ".[course]"'))
    from minifer_course.common import GPU_PAIR, TRACK_ENV, gpu_track_download_note

    if (track or "cpu").lower() == "gpu":
        if gpu_capability is None:
            rows.append(("track", "warn", f"{TRACK_ENV}=gpu but no CUDA GPU: the notebooks fall back to the CPU track"))
        else:
            rows.append(("track", "ok", f"{TRACK_ENV}=gpu: {gpu_track_download_note(GPU_PAIR)}"))
    else:
        rows.append(("track", "ok", f"CPU track (the bundled pair, no download); {TRACK_ENV}=gpu opts into the "
                                    f"GPU track: {gpu_track_download_note(GPU_PAIR)}"))
    return rows


def main() -> int:
    import torch

    ok = True
    rows: list[tuple[str, str]] = [
        ("python", platform.python_version()), ("platform", f"{platform.system()} {platform.machine()}"),
        ("minifer", _version("minifer")), ("torch", torch.__version__), ("transformers", _version("transformers")),
        ("tokenizers", _version("tokenizers")), ("safetensors", _version("safetensors")),
    ]
    if torch.cuda.is_available():
        rows.append(("device", f"cuda: {torch.cuda.get_device_name(0)} (capability {torch.cuda.get_device_capability(0)})"))
    else:
        rows.append(("device", f"cpu ({os.cpu_count()} cores); no CUDA GPU"))
    from minifer_course.stacking import int8_dot_instructions

    fast_int8, which = int8_dot_instructions()  # decides whether quantization="w8a8" is fast on this CPU
    rows.append(("int8 dot-product (CPU)", which + ("" if fast_int8 is not False else
                                                    ": W8A8's integer matmul runs slower than float32 here")))
    from minifer.kernels import triton_available  # the one detection (tools/no_triton's shim answers it too)

    have_triton, why = triton_available()
    rows.append(("triton", _version("triton") if have_triton else "missing"))
    if not have_triton:
        rows.append(("triton kernels", f"skipped: {why}"))
    else:
        interp, aot = _triton_status()
        rows += [("triton interpreter (CPU)", interp), ("triton AOT compile", aot)]
        ok &= interp == "ok"
    from minifer import LLM, SamplingParams

    for name in ("tinystories-target", "tinystories-draft"):
        try:
            t0 = time.perf_counter()
            llm = LLM(name, device="cpu")
            out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
            rows.append((f"model {name}", f"ok ({sum(p.numel() for p in llm.model.parameters()) / 1e6:.1f}M params, "
                                          f"{time.perf_counter() - t0:.1f}s): {out[0].outputs[0].text!r}"))
        except Exception as e:  # noqa: BLE001
            rows.append((f"model {name}", f"FAILED {type(e).__name__}: {e}"))
            ok = False
    rows.append(("model hub", _hub_reachable()))
    cuda = torch.cuda.is_available()
    checks = install_checks(
        torch.__version__, torch.version.cuda, torch.cuda.get_device_capability(0) if cuda else None,
        torch.cuda.get_device_properties(0).total_memory if cuda else None, platform.system(),
        os.environ.get("MINIFER_TRACK"), torch_requirement(), importlib.util.find_spec("jupyterlab") is not None,
        have_triton)
    for name, level, message in checks:
        rows.append((name, message if level == "ok" else f"{level.upper()}: {message}"))
        ok &= level != "fail"
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("\nall good" if ok else "\nsomething needs attention (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
