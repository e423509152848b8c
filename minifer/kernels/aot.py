"""Compile every Triton kernel ahead of time for sm_80 (A100) and sm_90 (H100/H200) — no GPU needed.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` runs Triton's whole pipeline down to
PTX and a cubin. ``ptxas -v`` (bundled with Triton) then reports each kernel's registers, spills and
shared memory: a kernel that spills or needs more shared memory than the chip has would be slow or fail
to launch on the GPU, and this catches it in CPU-only CI.

    python -m minifer.kernels.aot --out runs/aot_report.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KernelSpec:
    name: str
    kernel: object  # a @triton.jit function (or its interpreter wrapper)
    signature: dict[str, str]
    constexprs: dict[str, int | float]
    num_warps: int = 4


def kernel_specs() -> list[KernelSpec]:
    """One spec per kernel and representative configuration (the shapes of the bundled target and Qwen3)."""
    from minifer.kernels import paged_attention as pa

    specs = [KernelSpec("store_kv[Hkv=8,D=128]", pa.store_kv_kernel,
                        {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
                         "slot_ptr": "*i64", "row": "constexpr", "BLOCK": "constexpr"},
                        {"row": 1024, "BLOCK": 1024})]
    decode_sig = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "tables_ptr": "*i32",
                  "ctx_ptr": "*i32", "out_ptr": "*bf16", "scale": "fp32", "table_stride": "i32",
                  "HKV": "constexpr", "GROUP": "constexpr", "GROUP_P2": "constexpr", "D": "constexpr",
                  "D_P2": "constexpr", "BLOCK_SIZE": "constexpr", "BS_P2": "constexpr"}
    for hkv, group, d in ((2, 4, 32), (8, 2, 128), (8, 4, 128)):
        specs.append(KernelSpec(f"paged_decode[Hkv={hkv},G={group},D={d},bs=16]", pa.paged_decode_kernel, decode_sig,
                                {"HKV": hkv, "GROUP": group, "GROUP_P2": group, "D": d, "D_P2": d,
                                 "BLOCK_SIZE": 16, "BS_P2": 16}))
    return specs


def _jit(kernel):
    """Under TRITON_INTERPRET=1, @triton.jit returns an interpreter wrapper; rebuild the real JITFunction."""
    from triton.runtime.jit import JITFunction

    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)


def _ptxas_usage(ptx: str, cc: int) -> dict[str, int]:
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(cc).path
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{cc}{'a' if cc == 90 else ''}", str(src), "-o",
                            str(Path(tmp) / "k.cubin")], capture_output=True, text=True)
    text = r.stdout + r.stderr
    def grab(pattern: str) -> int:
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0
    return {"registers": grab(r"Used (\d+) registers"), "spill_stores": grab(r"(\d+) bytes spill stores"),
            "spill_loads": grab(r"(\d+) bytes spill loads"), "stack_frame": grab(r"(\d+) bytes stack frame")}


def compile_all(ccs: tuple[int, ...] = (80, 90)) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rows = []
    for spec in kernel_specs():
        for cc in ccs:
            src = ASTSource(fn=_jit(spec.kernel), signature=spec.signature, constexprs=spec.constexprs)
            compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": spec.num_warps})
            usage = _ptxas_usage(compiled.asm["ptx"], cc)
            rows.append({"kernel": spec.name, "arch": f"sm_{cc}", "num_warps": spec.num_warps,
                         "shared_bytes": int(compiled.metadata.shared), "cubin_bytes": len(compiled.asm["cubin"]),
                         **usage, "spills": bool(usage["spill_stores"] or usage["spill_loads"])})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the report as JSON here")
    args = ap.parse_args()
    import triton

    rows = compile_all()
    for r in rows:
        flag = "  SPILLS" if r["spills"] else ""
        print(f"{r['kernel']:<44} {r['arch']}  regs {r['registers']:>3}  smem {r['shared_bytes']:>6} B{flag}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"triton": triton.__version__, "kernels": rows}, indent=2))


if __name__ == "__main__":
    main()
