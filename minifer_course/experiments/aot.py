"""Compile every Triton kernel ahead of time for the GPUs learners have — no GPU needed: sm_75 (T4),
sm_80 (A100), sm_89 (L4) and sm_90 (H100/H200).

``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` runs Triton's whole pipeline down to
PTX and a cubin. ``ptxas -v`` (bundled with Triton) then reports each kernel's registers, spills and
shared memory: a kernel that spills or needs more shared memory than the chip has would be slow or fail
to launch on the GPU, and this catches it in CPU-only CI. ``nvdisasm`` (bundled too) turns the cubin into
SASS, the instructions the GPU runs, and the report counts those of each kernel's main loop, per weight
it decodes: a decode kernel that must keep up with the memory has a budget of a few (chapter 05).

    python -m minifer_course.experiments.aot --out runs/aot_report.json                 # every kernel, sm_80 and sm_90
    python -m minifer_course.experiments.aot --ccs 75 80 89 90 --out runs/aot_archs.json   # ... for every GPU CI checks
    python -m minifer_course.experiments.aot --all-configs --out runs/aot_all.json      # every autotuning config

Each architecture is compiled as it runs: below compute capability 8.0 (the T4) in float16, the dtype
``dtype="auto"`` gives it (no bfloat16 there), with the quantized kernels' Turing configs
(``quant_matmul.TURING_CONFIGS``: Triton has no tensor-core dot below sm_80, so its dots run on the CUDA
cores and the large tiles of the other lists spill); fp8 converts in hardware from sm_89, as at run time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class KernelSpec:
    name: str
    kernel: object  # a @triton.jit function (or its interpreter wrapper)
    signature: dict[str, str]
    constexprs: dict[str, int | float]
    num_warps: int = 4
    num_stages: int = 3
    arch_constexprs: dict[int, dict[str, int | float]] = field(default_factory=dict)  # per-cc overrides
    # Arguments to compile as multiples of 16 (pointers: 16-byte aligned), as Triton specializes them at
    # run time for torch allocations and real shapes; without it the report shows unvectorized loads.
    aligned: tuple[str, ...] = ()
    weights_per_step: int = 0  # weights one program reads per main-loop iteration (0: not a weight loop)


FP8_NATIVE_CCS = (89, 90)  # e4m3 conversions in hardware (quant_matmul._fp8_native: capability >= 8.9)
TURING = 80  # below this compute capability: float16 activations and the Turing configs


def for_arch(spec: KernelSpec, cc: int) -> KernelSpec:
    """``spec`` as it compiles for ``cc``: below sm_80, in float16 (what ``dtype="auto"`` runs there)."""
    if cc >= TURING:
        return spec
    from dataclasses import replace

    from minifer.kernels.quant_matmul import X_FP16

    signature = {k: "*fp16" if v == "*bf16" else v for k, v in spec.signature.items()}
    constexprs = {**spec.constexprs, **({"XKIND": X_FP16} if "XKIND" in spec.constexprs else {})}
    return replace(spec, signature=signature, constexprs=constexprs)


def kernel_specs(cc: int = 80) -> list[KernelSpec]:
    """One spec per kernel and representative configuration (the shapes of the bundled target and Qwen3), as
    compiled for compute capability ``cc`` (``for_arch``; the quantized kernels' configs of that GPU)."""
    from minifer.kernels import triton_attention as pa

    specs = [KernelSpec("store_kv[Hkv=8,D=128]", pa.store_kv_kernel,
                        {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
                         "slot_ptr": "*i64", "row": "constexpr", "BLOCK": "constexpr"},
                        {"row": 1024, "BLOCK": 1024})]
    def decode_sig(cache: str, scales: str) -> dict[str, str]:
        return {"q_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache, "tables_ptr": "*i32",
                "ctx_ptr": "*i32", "out_ptr": "*bf16", "scale": "fp32", "table_stride": "i32",
                "k_scale_ptr": scales, "v_scale_ptr": scales, "HKV": "constexpr", "GROUP": "constexpr",
                "GROUP_P2": "constexpr", "D": "constexpr", "D_P2": "constexpr", "BLOCK_SIZE": "constexpr",
                "BS_P2": "constexpr", "KV": "constexpr", "SCALES": "constexpr", "FP8_NATIVE": "constexpr"}

    def shape(hkv: int, group: int, d: int) -> dict[str, int]:
        return {"HKV": hkv, "GROUP": group, "GROUP_P2": group, "D": d, "D_P2": d, "BLOCK_SIZE": 16, "BS_P2": 16}

    for hkv, group, d in ((2, 4, 32), (8, 2, 128), (8, 4, 128)):
        specs.append(KernelSpec(f"paged_decode[Hkv={hkv},G={group},D={d},bs=16]", pa.paged_decode_kernel,
                                decode_sig("*bf16", "*bf16"), {**shape(hkv, group, d), "KV": pa.KV_FLOAT,
                                                               "SCALES": pa.SCALES_NONE, "FP8_NATIVE": False}))
    # the 8-bit caches (Qwen3-0.6B's shape): int8 and fp8 codes with a scale per token and head, int8 with
    # static per-head scales; fp8 converts in hardware on sm_90, decodes its bits on sm_80
    for name, kv, scales, scale_type in (("int8", pa.KV_INT8, pa.SCALES_TOKEN, "*fp16"),
                                         ("fp8", pa.KV_FP8, pa.SCALES_TOKEN, "*fp16"),
                                         ("int8 static", pa.KV_INT8, pa.SCALES_HEAD, "*fp32")):
        specs.append(KernelSpec(f"paged_decode[{name},Hkv=8,G=2,D=128,bs=16]", pa.paged_decode_kernel,
                                decode_sig("*i8", scale_type), {**shape(8, 2, 128), "KV": kv, "SCALES": scales,
                                                                "FP8_NATIVE": False},
                                arch_constexprs={c: {"FP8_NATIVE": True} for c in FP8_NATIVE_CCS}
                                if kv == pa.KV_FP8 else {}))
    return [for_arch(s, cc) for s in specs] + quant_matmul_specs(cc=cc)


def quant_matmul_specs(all_configs: bool = False, cc: int = 80) -> list[KernelSpec]:
    """The fused dequantize-matmul kernels for bf16 activations, at a GPU's tile sizes for a Llama-8B-sized layer
    (K = 4096, int4 groups of 128; and of 32, quant_gemm_kernel's int4 branch). fp8 converts natively from sm_89,
    by bit arithmetic below. ``weights_per_step``, what one program reads per main-loop iteration, divides the
    report's instructions into instructions per weight.

    By default one spec per kernel and path: the first config of each of the GPU's autotuning lists (what
    CI compiles and ``aot_report.json`` holds). ``all_configs`` gives every distinct config of those lists
    instead (the ones that compile differently: ``SPLIT_PER_SM`` is a run-time argument), each named with
    its warps and stages (``aot_report_all_configs.json``): the autotuner may pick any of them. ``cc``
    below 80 takes the Turing lists (``quant_matmul.gpu_configs``) and float16 (``for_arch``)."""
    from minifer.kernels import quant_matmul as qm

    pick = _distinct if all_configs else (lambda configs: configs[:1])
    lists = {path: qm.gpu_configs(path, turing=cc < TURING) for path in qm.CONFIG_PATHS}
    specs = []
    for fmt, code in (("int8", qm.INT8), ("int4", qm.INT4), ("int4-asym", qm.INT4), ("fp8", qm.FP8)):
        int4 = code == qm.INT4
        sig, aligned = _quant_signature(fmt, int4)
        common = {"FMT": code, "GROUP": 128 if int4 else 0, "HAS_ZEROS": fmt == "int4-asym", "HAS_BIAS": True,
                  "FP8_NATIVE": False, "XKIND": qm.X_BF16}
        per_arch = {c: {"FP8_NATIVE": True} for c in FP8_NATIVE_CCS} if code == qm.FP8 else {}
        gw = 128 // 8 if int4 else qm.CHUNK_BYTES  # int4 gemv reads W as int32 words, a group is 16 of them

        def spec(name: str, kernel, signature: dict, tile: dict, cfg, arch: dict, weights: int) -> KernelSpec:
            suffix = f",w{cfg.num_warps}s{cfg.num_stages}" if all_configs else ""
            return for_arch(KernelSpec(f"{name[:-1]}{suffix}]", kernel, signature, tile, cfg.num_warps,
                                       cfg.num_stages, arch, aligned, weights), cc)

        for cfg in pick(lists["gemv"]):
            n, c = cfg.kwargs["BLOCK_N"], cfg.kwargs["CHUNKS"]
            specs.append(spec(f"quant_gemv[{fmt},BN={n},chunks={c}]", qm.quant_gemv_kernel,
                              {**{k: v for k, v in sig.items() if k != "SPLIT_PER_SM"},
                               "q_ptr": "*i32" if int4 else "*i8", "magic": "i32", "SPLIT_PER_SM": "i32",
                               **{k: "constexpr" for k in (*common, "GW", "GW_P2", "BLOCK_N", "CHUNKS")}},
                              {**common, "GW": gw, "GW_P2": gw, "BLOCK_N": n, "CHUNKS": c}, cfg, per_arch,
                              n * c * gw * (8 if int4 else 1)))  # BLOCK_N rows x CHUNKS chunks of GW units
        gemm_sig = {**sig, **{k: "constexpr" for k in (*common, "DOT_F32", "BLOCK_M", "BLOCK_N", "BLOCK_K",
                                                        "GROUP_M")}}
        mma_sig = {**sig, "q_ptr": "*i32", "x_ptr": "*bf16",
                   **{k: "constexpr" for k in (*common, "DOT_F32", "ONE_DOT", "BLOCK_M", "BLOCK_N", "BLOCK_K")}}
        for path in ("splitk", "tiled"):
            if int4:  # int4 in groups of a multiple of 64 runs its own tensor-core kernel on both paths
                for cfg in pick(lists["int4_mma" if path == "splitk" else "int4_mma_tiled"]):
                    t = {k: v for k, v in cfg.kwargs.items() if k != "SPLIT_PER_SM"}
                    specs.append(spec(f"quant_int4_mma[{fmt},{t['BLOCK_M']}x{t['BLOCK_N']}x{t['BLOCK_K']}]",
                                      qm.quant_int4_mma_kernel, mma_sig,
                                      {**common, "DOT_F32": False, "ONE_DOT": False, **t}, cfg,
                                      {90: {"ONE_DOT": True}}, t["BLOCK_N"] * t["BLOCK_K"]))
                continue
            for cfg in pick(lists[path]):
                t = {k: v for k, v in cfg.kwargs.items() if k != "SPLIT_PER_SM"}
                specs.append(spec(f"quant_gemm[{fmt},{path},{t['BLOCK_M']}x{t['BLOCK_N']}x{t['BLOCK_K']}]",
                                  qm.quant_gemm_kernel, gemm_sig, {**common, "DOT_F32": False, **t}, cfg, per_arch,
                                  t["BLOCK_N"] * t["BLOCK_K"]))
        if fmt == "int4":  # groups of 32 keep quant_gemm_kernel's int4 branch: K-steps of 32 codes
            for path in ("splitk", "tiled"):
                for cfg in _distinct(_with_block_k(pick(lists[path]), 32)):
                    t = {k: v for k, v in cfg.kwargs.items() if k != "SPLIT_PER_SM"}
                    specs.append(spec(f"quant_gemm[int4-g32,{path},{t['BLOCK_M']}x{t['BLOCK_N']}x32]",
                                      qm.quant_gemm_kernel, gemm_sig, {**common, "GROUP": 32, "DOT_F32": False, **t},
                                      cfg, per_arch, t["BLOCK_N"] * 32))
    return specs


def _quant_signature(fmt: str, int4: bool) -> tuple[dict[str, str], tuple[str, ...]]:
    """The run-time arguments the quantized kernels share, with their types for bf16 activations, and those that
    compile as multiples of 16 (``KernelSpec.aligned``)."""
    sig = {"x_ptr": "*i32" if int4 else "*bf16", "q_ptr": "*u8" if int4 else "*i8", "s_ptr": "*fp32",
           "z_ptr": "*u8" if fmt == "int4-asym" else "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
           "part_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "ROW": "i32",
           "M_KEY": "i32", "SPLIT_PER_SM": "i32"}
    return sig, tuple(a for a in sig if a.endswith("_ptr")) + ("N", "K", "ROW")


def _distinct(configs: list) -> list:
    """The configs that compile differently: ``SPLIT_PER_SM`` only changes the launch grid."""
    seen, out = set(), []
    for cfg in configs:
        key = (tuple(sorted((k, v) for k, v in cfg.kwargs.items() if k != "SPLIT_PER_SM")), cfg.num_warps,
               cfg.num_stages)
        if key not in seen:
            seen.add(key)
            out.append(cfg)
    return out


def _with_block_k(configs: list, block_k: int) -> list:
    import triton

    return [triton.Config({**c.kwargs, "BLOCK_K": block_k}, num_warps=c.num_warps, num_stages=c.num_stages)
            for c in configs]


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


def loop_instructions(cubin: bytes) -> int | None:
    """SASS instructions in the kernel's largest loop (its main loop), from ``nvdisasm``; None without it."""
    try:
        from triton import knobs

        nvdisasm = knobs.nvidia.nvdisasm.path
    except Exception:  # pragma: no cover - a Triton without the bundled tool
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        r = subprocess.run([nvdisasm, "-c", str(path)], capture_output=True, text=True)
    if r.returncode:
        return None
    lines = r.stdout.splitlines()
    labels, best = {}, (0, -1)
    for i, line in enumerate(lines):
        if (m := re.match(r"\s*(\.L_x_\d+):", line)):
            labels[m.group(1)] = i
        elif (m := re.search(r"BRA `?\(?(\.L_x_\d+)", line)) and m.group(1) in labels:  # a backward branch
            if i - labels[m.group(1)] > best[1] - best[0]:
                best = (labels[m.group(1)], i)
    return sum(1 for line in lines[best[0]:best[1] + 1] if re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+\S", line))


ALL_CCS = (75, 80, 89, 90)  # T4, A100, L4, H100/H200


def compile_all(ccs: tuple[int, ...] = (80, 90), specs: list[KernelSpec] | None = None) -> list[dict]:
    """Compile ``specs`` for each compute capability; one report row per pair. Without ``specs``, every
    kernel as that architecture runs it (``kernel_specs(cc)``: the names differ where its configs do).

    Under the interpreter (``TRITON_INTERPRET=1``, as in CPU-only tests) the compile runs in a fresh
    process without it: once a kernel that calls a ``@triton.jit`` helper (``tl.sum``, ``tl.cdiv``, ...) has
    been interpreted, Triton 3.9 leaves ``triton.language.core`` patched for the interpreter, and compiling
    in that process fails."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return _compile_in_subprocess(ccs, None if specs is None else [s.name for s in specs])
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if specs is None:
        pairs = [(spec, cc) for cc in ccs for spec in kernel_specs(cc)]
    else:
        pairs = [(for_arch(spec, cc), cc) for spec in specs for cc in ccs]
    rows = []
    for spec, cc in pairs:
        constexprs = {**spec.constexprs, **spec.arch_constexprs.get(cc, {})}
        names = list(spec.signature)
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in spec.aligned}
        src = ASTSource(fn=_jit(spec.kernel), signature=spec.signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                                  options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
        usage = _ptxas_usage(compiled.asm["ptx"], cc)
        loop = loop_instructions(compiled.asm["cubin"]) if spec.weights_per_step else None
        per_thread = spec.weights_per_step / (32 * spec.num_warps)
        rows.append({"kernel": spec.name, "arch": f"sm_{cc}", "num_warps": spec.num_warps,
                     "num_stages": spec.num_stages,
                     "shared_bytes": int(compiled.metadata.shared), "cubin_bytes": len(compiled.asm["cubin"]),
                     **usage, "spills": bool(usage["spill_stores"] or usage["spill_loads"]),
                     "loop_instructions": loop,
                     "instructions_per_weight": None if loop is None else round(loop / per_thread, 2)})
    return rows


def ptxas_version(cc: int) -> str:
    """The CUDA release of the ptxas Triton assembles for ``cc`` with (its own copies, one per architecture
    range, unless TRITON_PTXAS_PATH names another): the same PTX can become different machine code in
    another release, so the report names it."""
    from triton.backends.nvidia.compiler import get_ptxas

    out = subprocess.run([get_ptxas(cc).path, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else "unknown"


def _compile_in_subprocess(ccs: tuple[int, ...], names: list[str] | None) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "minifer_course.experiments.aot", "--json", "--ccs", *map(str, ccs)]
    cmd += ["--only", *names] if names is not None else []
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    if r.returncode:
        raise RuntimeError(f"ahead-of-time compile failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the report as JSON here")
    ap.add_argument("--ccs", type=int, nargs="+", default=[80, 90],
                    help="compute capabilities (default 80 90; 75 80 89 90 for every GPU CI checks)")
    ap.add_argument("--only", nargs="+", help="compile only the specs of these names")
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON line instead of a table")
    ap.add_argument("--all-configs", action="store_true",
                    help="every distinct config of the quantized kernels' GPU autotuning lists, instead of every kernel")
    args = ap.parse_args()
    import triton

    rows = []
    for cc in args.ccs:
        every = quant_matmul_specs(all_configs=True, cc=cc) if args.all_configs else kernel_specs(cc)
        specs = [s for s in every if args.only is None or s.name in args.only]
        rows += compile_all((cc,), specs)
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            flag = "  SPILLS" if r["spills"] else ""
            ipw = r["instructions_per_weight"]
            per_w = "" if ipw is None else f"  {ipw:5.2f} instr/weight"
            print(f"{r['kernel']:<44} {r['arch']}  regs {r['registers']:>3}  smem {r['shared_bytes']:>6} B"
                  f"{per_w}{flag}")
    if args.out:
        from minifer.bench.provenance import metadata, save_result

        ptxas = {f"sm_{cc}": ptxas_version(cc) for cc in args.ccs}
        save_result({"kind": "aot", "metadata": metadata(module="minifer_course.experiments.aot"),
                     "triton": triton.__version__, "ptxas": ptxas, "kernels": rows}, args.out, indent=2)


if __name__ == "__main__":
    main()
