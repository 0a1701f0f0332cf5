"""The benchmark report's rows that are computed rather than timed."""

from __future__ import annotations

import math
import shutil
import subprocess

import pytest

from NeuralRaycastLib.bench.report import frame_notes, timed_each
from NeuralRaycastLib.bench.suites import memory_row


def test_memory_row_reports_the_largest_sample_and_lists_them_all():
    row = memory_row({"field and trainer made": 3 << 30, "training done": 5 << 30, "1024² renders": None,
                      "512² renders": 4 << 30})
    assert row.value == 5.0 and row.unit == "GiB"
    assert row.notes.startswith("after training done;")
    assert "field and trainer made 3.00" in row.notes and "512² renders 4.00" in row.notes
    assert "1024²" not in row.notes


def test_memory_row_says_when_the_device_does_not_tell():
    row = memory_row({"training done": None})
    assert math.isnan(row.value) and "not readable" in row.notes


def test_memory_row_names_the_budget_the_work_was_sized_to():
    """bench --gpu-memory: the memory row says which budget the measured work was sized to, readable or not."""
    from NeuralRaycastLib.gpu.memory_budget import GIB, MemoryBudget

    budget = MemoryBudget(4 * GIB, "--gpu-memory")
    for samples in ({"training done": 3 << 30}, {"training done": None}):
        assert memory_row(samples, budget).notes.endswith("; sized to a GPU memory budget of 4.0 GiB (--gpu-memory)")


def test_warps_an_sm_holds_follow_from_registers_and_shared_memory():
    """What the kernels suite reports beside each kernel: 255 registers a thread (the fit's) leave room for 8
    of slangpy's one-warp groups on an H100 SM; even a small kernel gets 32 of 64 warps (32 groups at most)."""
    from NeuralRaycastLib.bench.kernel_resources import resident_warps

    assert resident_warps(255) == resident_warps(255, 16384) == 8
    assert (resident_warps(168), resident_warps(128), resident_warps(72, 1024), resident_warps(32)) == (12, 16, 28, 32)
    assert resident_warps(32, 48 * 1024) == 4  # shared memory bounds it first
    assert resident_warps(32, threads_per_group=128) == 64


PTXAS_REPORT = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'compute_main' for 'sm_90'
ptxas info    : Function properties for compute_main
    3072 bytes stack frame, 988 bytes spill stores, 960 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 3072 bytes cumulative stack size, 16384 bytes smem
ptxas info    : Function properties for helper
    0 bytes stack frame, 752 bytes spill stores, 756 bytes spill loads
"""


def test_the_entry_functions_figures_are_read_from_a_ptxas_report():
    from NeuralRaycastLib.bench.kernel_resources import parse_ptxas_report

    kernel = parse_ptxas_report(PTXAS_REPORT, 910754)
    assert (kernel.registers, kernel.spill_stores, kernel.spill_loads, kernel.shared_bytes) == (255, 988, 960, 16384)
    assert kernel.warps_per_sm() == 8


def test_kernels_in_a_shader_cache_are_found_and_assembled(tmp_path):
    """PTX kept in a database file among other bytes is found once each, largest first, and ptxas reads it
    (with the CUDA toolkit on this machine; no GPU is needed); the kernels suite reports each."""
    from NeuralRaycastLib.bench.kernel_resources import find_ptxas, ptx_programs, ptxas_resources

    if shutil.which("nvcc") is None or find_ptxas() is None:
        pytest.skip("no CUDA toolkit (nvcc, ptxas) on this machine")
    sources = {
        "small": 'extern "C" __global__ void small(float* y) { y[threadIdx.x] = 2.0f * y[threadIdx.x]; }\n',
        "big": """extern "C" __global__ void big(const float* x, float* y, int n) {
    __shared__ float tile[256];
    float a[48];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    for (int k = 0; k < 48; k++) a[k] = x[(i + 7 * k) % n];
    tile[threadIdx.x % 256] = a[1];
    __syncthreads();
    float s = 0.0f;
    for (int k = 0; k < 48; k++) s += a[k] * a[(5 * k) % 48] + tile[(threadIdx.x + k) % 256];
    y[i % n] = s;
}
""",
    }
    texts = []
    for name, source in sources.items():  # one program per kernel, as the shader cache keeps them
        (tmp_path / f"{name}.cu").write_text(source)
        subprocess.run(["nvcc", "-ptx", "-arch=compute_90", str(tmp_path / f"{name}.cu"), "-o",
                        str(tmp_path / f"{name}.ptx")], check=True, capture_output=True)
        texts.append((tmp_path / f"{name}.ptx").read_text())
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "data.mdb").write_bytes(b"\x00\x07key" + texts[0].encode() + b"\x00\x13" + texts[1].encode()
                                     + b"\x00padding" + texts[0].encode() + b"\x00")
    programs = ptx_programs(cache)
    assert programs == sorted((text[text.index(".version"):] for text in texts), key=len, reverse=True)
    big = ptxas_resources(programs[0], "sm_90", find_ptxas())
    small = ptxas_resources(programs[1], "sm_90", find_ptxas())
    assert big.shared_bytes == 1024 and small.shared_bytes == 0
    assert big.registers > small.registers > 0 and big.spill_stores == small.spill_stores == 0

    from types import SimpleNamespace

    from NeuralRaycastLib.bench.suites import bench_kernels

    device = SimpleNamespace(backend="cuda", report=SimpleNamespace(shader_cache=str(cache), compute_capability=90))
    count, first, second = bench_kernels(device, None, True, lambda *_: None)
    assert count.value == 2 and "sm_90" in count.notes
    assert (first.value, second.value) == (big.registers, small.registers)
    assert f"{big.warps_per_sm()} of 64 warps per SM" in first.notes and "shared memory 1024 bytes" in first.notes


def test_the_kernels_suite_says_why_it_has_nothing_off_cuda():
    from types import SimpleNamespace

    from NeuralRaycastLib.bench.suites import bench_kernels

    (row,) = bench_kernels(SimpleNamespace(backend="vulkan"), None, True, lambda *_: None)
    assert row.metric == "not measured" and math.isnan(row.value) and "vulkan" in row.notes


def test_frame_rows_say_how_single_slow_frames_pull_the_mean():
    """A frame-time row's value is the mean of its frames; its notes give the median and the extremes, so a
    reader sees when one slow frame made the mean."""
    seconds = [0.0160, 0.0158, 0.0410, 0.0159]
    notes = frame_notes(seconds)
    assert notes.startswith("4 runs incl. read-back: median 15.95 ms")
    assert "fastest 15.80 ms" in notes and "slowest 41.00 ms" in notes
    assert frame_notes([0.0160]) == "1 run incl. read-back"
    calls = []
    each = timed_each(lambda: calls.append(1), min_seconds=10.0, max_repeats=3)
    assert len(each) == len(calls) == 3 and all(s >= 0.0 for s in each)


def test_the_prepare_suite_times_preparing_afresh_and_leaves_no_cache_entry(tiny_brats):
    """Both rows (the whole of preparing, and the mask and boundary maps alone) come from fresh work: the
    prepared-study cache gains no entry."""
    from NeuralRaycastLib.bench.suites import SUITES
    from NeuralRaycastLib.paths import cache_folder
    from NeuralRaycastLib.study.preprocess import prepare
    from NeuralRaycastLib.study.study import load_study

    prepared = prepare(load_study(tiny_brats), use_cache=False)
    folder = cache_folder("prepared")
    before = sorted(folder.iterdir()) if folder.is_dir() else []
    rows = SUITES["prepare"](None, prepared, True, lambda message, fraction: None)
    assert [row.metric for row in rows] == ["prepare without cache", "brain mask and boundary maps"]
    for row in rows:
        assert row.suite == "prepare" and row.unit == "s" and 0 < row.value < math.inf
        assert "fastest of 1" in row.notes and "20 × 22 × 18 voxels, 4 structures" in row.notes
    assert (sorted(folder.iterdir()) if folder.is_dir() else []) == before
