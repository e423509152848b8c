"""``python -m minifer doctor``: is this installation ready for the course?

Prints versions, the compute device, whether Triton can run kernels (GPU, or the CPU interpreter) and
compile them ahead of time for sm_80/sm_90, whether the bundled models load and generate, and whether a
model hub is reachable. Exit code 0 when everything the CPU track needs works.
"""

from __future__ import annotations

import importlib
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
for cc in (80, 90):
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
    """Triton kernels on CPU tensors (interpreter) and compiled ahead of time for sm_80 / sm_90 (no GPU needed)."""
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
    triton_version = _version("triton")
    rows.append(("triton", triton_version))
    if triton_version.startswith("missing"):
        rows.append(("triton kernels", "skipped: Triton has no wheels for this platform (macOS?); the CPU path runs"))
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
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("\nall good" if ok else "\nsomething needs attention (see above)")
    return 0 if ok else 1
