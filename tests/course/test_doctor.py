"""``python -m minifer_course.doctor``'s install-route checks, each case without the hardware it describes: the
checks are a pure function of what the machine reports."""

from __future__ import annotations

import pytest

from minifer_course.doctor import CPU_INDEX, install_checks, torch_requirement

LAPTOP = dict(torch_version="2.13.0+cpu", cuda_build=None, gpu_capability=None, gpu_memory_bytes=None,
              system="Linux", track=None, requirement="torch<2.16,>=2.12", have_jupyterlab=True, have_triton=True)


def checks(**changes) -> dict[str, tuple[str, str]]:
    return {name: (level, msg) for name, level, msg in install_checks(**{**LAPTOP, **changes})}


def test_a_cpu_laptop_on_the_cpu_route_is_all_ok():
    rows = checks()
    assert {level for level, _ in rows.values()} == {"ok"}, rows
    assert rows["torch build"][1] == "CPU build" and "2.13.0+cpu is in" in rows["torch range"][1]
    assert "downloads Qwen/Qwen3-1.7B" in rows["track"][1] and "MINIFER_TRACK=gpu" in rows["track"][1]


def test_a_cuda_build_without_a_gpu_is_warned_with_the_cpu_route():
    level, msg = checks(torch_version="2.13.0", cuda_build="13.0")["torch build"]
    assert level == "warn" and "no CUDA GPU" in msg and CPU_INDEX in msg


def test_a_torch_outside_the_tested_range_is_warned():
    assert checks(torch_version="2.9.1")["torch range"][0] == "warn"
    assert checks(torch_version="2.16.0")["torch range"][0] == "warn"
    assert checks(torch_version="2.15.0")["torch range"][0] == "ok"


@pytest.mark.parametrize("capability,dtype", [((7, 5), "float16"), ((8, 0), "bfloat16"), ((8, 9), "bfloat16"),
                                              ((9, 0), "bfloat16")])
def test_each_gpu_generation_gets_its_dtype_and_compiled_kernels(capability, dtype):
    rows = checks(torch_version="2.13.0", cuda_build="13.0", gpu_capability=capability, gpu_memory_bytes=16 * 10**9)
    assert rows["torch build"][0] == "ok" and rows["GPU dtype"][1].split("runs in ")[1].startswith(dtype)
    assert "GPU kernels" not in rows  # sm_75/80/89/90: compiled ahead of time in CI
    assert rows["GPU memory"][0] == "ok", rows["GPU memory"]


def test_an_unchecked_architecture_a_small_gpu_and_the_gpu_track_without_one():
    rows = checks(cuda_build="12.8", gpu_capability=(6, 1), gpu_memory_bytes=8 * 2**30)
    assert rows["GPU kernels"][0] == "warn" and "sm_61" in rows["GPU kernels"][1]
    assert rows["GPU memory"][0] == "warn" and "CPU track" in rows["GPU memory"][1]
    assert checks(track="gpu")["track"][0] == "warn"


def test_missing_pieces():
    assert checks(have_triton=False)["triton"][0] == "fail"  # Linux: the kernels' chapters need it
    assert checks(have_triton=False, system="Darwin")["triton"][0] == "ok"  # no wheels there: the CPU path runs
    assert checks(have_jupyterlab=False)["course extra"][0] == "warn"
    assert "torch range" not in checks(requirement=None)


def test_torch_requirement_reads_an_installed_range():
    req = torch_requirement()
    assert req is None or req.startswith("torch")
