"""The GPU memory budget: how an amount is written, where the budget comes from, and how a run is sized to it
(the study's grid, the patches and SDF points of a step), without a GPU."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from NeuralRaycastLib.gpu.device import GpuMemoryError
from NeuralRaycastLib.gpu.memory_budget import (
    CUDA_PROCESS_BYTES,
    GIB,
    GPU_MEMORY_ENV,
    MIB,
    SHARES,
    SOFTWARE_BYTES,
    UNKNOWN_GPU_BYTES,
    MemoryBudget,
    parse_memory,
    resolve_budget,
)
from NeuralRaycastLib.study.study import downsample_factors
from NeuralRaycastLib.train.memory import (
    check_run_fits,
    schedule_within_budget,
    settings_within_budget,
    study_voxel_limit,
    training_bytes_per_ray,
    volume_bytes_per_voxel,
)
from NeuralRaycastLib.train.presets import RunSettings, training_schedule


@pytest.mark.parametrize(("text", "expected"), [
    ("6G", 6 * GIB), ("6GiB", 6 * GIB), ("6gb", 6 * GIB), ("6 GiB", 6 * GIB), ("6000M", 6000 * MIB),
    ("1.5G", 3 * GIB // 2), ("64MiB", 64 * MIB), ("512m", 512 * MIB), ("2097152", 2 * MIB), ("1T", 1024 * GIB),
    ("auto", None), ("", None), (" AUTO ", None),
])
def test_amounts_are_read_in_binary_units(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize(("text", "words"), [
    ("6X", "'6X' is not an amount of memory"), ("-1G", "'-1G' is not an amount"), ("six", "'six' is not"),
    ("G", "'G' is not"), ("6 G B x", "is not an amount"), ("0", "less than the smallest budget, 1 MiB"),
    ("512K", "less than the smallest budget"),
])
def test_a_bad_amount_is_one_line_naming_where_it_was_given_and_how_to_write_it(text, words):
    with pytest.raises(ValueError) as raised:
        parse_memory(text, "--gpu-memory")
    message = str(raised.value)
    assert message.startswith("--gpu-memory: ") and words in message and "6G" in message and "\n" not in message


def test_the_budget_is_the_option_else_the_variable_else_the_device(monkeypatch):
    monkeypatch.setenv(GPU_MEMORY_ENV, "3G")
    assert resolve_budget("6G", 70 * GIB, 80 * GIB, False) == MemoryBudget(6 * GIB, "--gpu-memory")
    assert resolve_budget(None, 70 * GIB, 80 * GIB, False) == MemoryBudget(3 * GIB, f"${GPU_MEMORY_ENV}")
    assert resolve_budget("auto", 70 * GIB, 80 * GIB, False).bytes == 3 * GIB  # auto: not given here
    monkeypatch.setenv(GPU_MEMORY_ENV, "lots")
    with pytest.raises(ValueError, match=f"^\\${GPU_MEMORY_ENV}: 'lots' is not an amount of memory"):
        resolve_budget(None, 70 * GIB, 80 * GIB, False)
    monkeypatch.delenv(GPU_MEMORY_ENV)
    # CUDA: the free memory less a twentieth of the GPU's (or 512 MiB on a small one)
    assert resolve_budget(None, 70 * GIB, 80 * GIB, False) == MemoryBudget(66 * GIB, "the GPU's free memory")
    assert resolve_budget(None, 6 * GIB, 8 * GIB, False).bytes == 6 * GIB - 512 * MIB
    assert resolve_budget(None, 100 * MIB, 8 * GIB, False).bytes >= MIB  # a full GPU: the least, never negative
    # where the device cannot tell: a common card's size, or the default of a software device
    assert resolve_budget(None, None, None, False).bytes == UNKNOWN_GPU_BYTES == 8 * GIB
    assert resolve_budget(None, None, None, True).bytes == SOFTWARE_BYTES == 4 * GIB


def test_a_budget_given_for_a_cuda_device_is_the_whole_process_its_context_included():
    """On CUDA a given budget is what the process may hold in all: its context and slangpy's heaps are set aside
    (at most half of a small budget) before the work is sized; the device's own figure is measured after them."""
    given = resolve_budget("4G", 70 * GIB, 80 * GIB, False, cuda=True)
    assert (given.bytes, given.held) == (4 * GIB, CUDA_PROCESS_BYTES)
    assert given.share("training") == int((4 * GIB - CUDA_PROCESS_BYTES) * SHARES["training"])
    assert resolve_budget("32M", 70 * GIB, 80 * GIB, False, cuda=True).work_bytes == 16 * MIB
    assert resolve_budget("4G", None, None, False).held == 0  # Vulkan, Metal, a software device: not measured
    assert resolve_budget(None, 70 * GIB, 80 * GIB, False, cuda=True).held == 0


def test_the_standard_preset_trains_unchanged_in_4_gib_and_with_fewer_patches_below():
    """A budget of 4 GiB (the issue's small card) holds the standard preset's steps as they are; a smaller one
    takes fewer patches a step, within its share, and says so naming the budget and both counts."""
    standard = training_schedule("standard")
    for budget in (MemoryBudget(66 * GIB, "the GPU's free memory"), MemoryBudget(4 * GIB, "--gpu-memory")):
        assert schedule_within_budget(standard, budget, 4) == (standard, None)
    budget = MemoryBudget(512 * MIB, "--gpu-memory")
    sized, note = schedule_within_budget(standard, budget, 4)
    per_patch = standard.patch_size**2 * training_bytes_per_ray(standard.max_samples, 4)
    assert 1 <= sized.patches < standard.patches and sized.patches * per_patch <= budget.share("training")
    assert (sized.patches + 1) * per_patch > budget.share("training")  # as many as fit
    assert note == (f"a GPU memory budget of 512 MiB (--gpu-memory) holds {sized.patches} of the preset's "
                    f"{standard.patches} patches a step ({sized.patches * 256:,} rays): training takes smaller steps")
    assert replace(sized, patches=standard.patches) == standard  # nothing else changed


def test_sdf_points_a_step_are_cut_only_where_the_budget_cannot_hold_them():
    high = training_schedule("high")  # 262,144 points a step
    tiny = MemoryBudget(2 * MIB, "--gpu-memory")
    sized, note = schedule_within_budget(high, tiny, 4)
    points = tiny.share("training") // 4 // 32 * 32
    assert sized.geometry.batch == points < high.geometry.batch and sized.sdf_batch == min(high.sdf_batch, points)
    assert sized.geometry.batch % 32 == 0  # whole waves
    assert f"{points:,} SDF points a step (the preset's {high.geometry.batch:,})" in note


def fake_study(shape, spacing, structures=3, channels=1):
    """What sizing reads of a study: its grid, structures and channels (no voxels held)."""
    return SimpleNamespace(shape=tuple(shape), spacing=np.asarray(spacing, float),
                           structures={f"s{k}": (k + 1,) for k in range(structures)},
                           channels={f"c{k}": None for k in range(channels)})


def downsampled_voxels(study, limit):
    factors = downsample_factors(study.shape, study.spacing, limit)
    return int(np.prod([n // f for n, f in zip(study.shape, factors, strict=True)])), factors


def test_a_large_study_is_downsampled_to_what_the_budget_holds_and_says_so():
    """A 512×512×400 volume does not fit a 4 GiB budget's share for volumes: its grid is coarsened until it does
    (whole factors, as --max-voxels coarsens), the limit kept in the run's settings, and a line says so."""
    study = fake_study((512, 512, 400), (0.5, 0.5, 0.5), structures=3, channels=4)
    budget = MemoryBudget(4 * GIB, "--gpu-memory")
    per_voxel = volume_bytes_per_voxel(4, 4)
    assert 512 * 512 * 400 * per_voxel > budget.share("volumes")
    settings, note = settings_within_budget(study, RunSettings("standard"), budget)
    limit = settings.max_voxels
    voxels, _factors = downsampled_voxels(study, limit)
    assert voxels * per_voxel <= budget.share("volumes")
    assert limit == 256  # halved on every axis, said as the longest axis it leaves
    finer = {downsampled_voxels(study, n)[0] for n in range(limit + 1, 513)} - {voxels}
    assert finer and all(v * per_voxel > budget.share("volumes") for v in finer)  # the finest grid that fits
    assert note.startswith("the study's 512×512×400 voxels take ") and f"(--max-voxels {limit})" in note
    assert "a GPU memory budget of 4.0 GiB (--gpu-memory)" in note
    # a stricter limit of the user's or the preset's is kept, and a study that fits is left alone
    assert settings_within_budget(study, RunSettings("quick", max_voxels=96), budget) == (
        RunSettings("quick", max_voxels=96), None)
    small = fake_study((240, 240, 155), (1.0, 1.0, 1.0), structures=3, channels=4)
    assert study_voxel_limit(small, budget) is None


def test_a_thin_sliced_scan_is_coarsened_in_plane_first():
    """A 0.5×0.5×5 mm scan under a budget too small for it: its thin in-plane voxels are merged towards its
    slice thickness; the 5 mm slices are not thinned further."""
    study = fake_study((512, 512, 40), (0.5, 0.5, 5.0), structures=1, channels=1)
    budget = MemoryBudget(256 * MIB, "--gpu-memory")
    limit = study_voxel_limit(study, budget)
    voxels, factors = downsampled_voxels(study, limit)
    assert voxels * volume_bytes_per_voxel(2, 1) <= budget.share("volumes")
    assert factors[2] == 1 and factors[0] == factors[1] > 1


def test_a_run_that_not_even_one_patch_fits_is_refused_naming_what_to_lower():
    layout = SimpleNamespace(count=1 << 20, gradient_count=1 << 20)
    prepared = SimpleNamespace(structures=[0, 1, 2, 3], channel_names=["t1"], study=SimpleNamespace(shape=(40, 40, 40)))
    quick = training_schedule("quick")
    check_run_fits(MemoryBudget(256 * MIB, "--gpu-memory"), layout, prepared, quick)  # fits: nothing raised
    with pytest.raises(GpuMemoryError) as raised:
        check_run_fits(MemoryBudget(16 * MIB, "--gpu-memory"), layout, prepared, quick)
    message = str(raised.value)
    assert message.startswith("a GPU memory budget of 16 MiB (--gpu-memory) cannot hold this run: the field and the "
                              "study's volumes take ")
    for what in ("--gpu-memory", "--preset quick", "--size", "--max-voxels"):
        assert what in message


def test_a_cut_said_on_a_terminal_stays_on_a_line_of_its_own():
    """On a terminal the progress bar redraws one line: a Note (work cut to fit the budget) is written on a line
    of its own, whole, so the next message does not overwrite it."""
    import io

    from NeuralRaycastLib.progress import ConsoleProgress, Note

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    progress = ConsoleProgress("fit", stream)
    note = "a GPU memory budget of 512 MiB (--gpu-memory) holds 28 of the preset's 128 patches a step (7,168 rays)"
    progress(Note(note), 0.0)
    progress("stage 2: loss 0.1", 0.5)
    lines = stream.getvalue().split("\n")
    assert lines[0].strip("\r").rstrip() == f"fit: {note}"
    assert "stage 2" in lines[-1] and note not in lines[-1]
    stream = Terminal()
    ConsoleProgress("fit", stream)("stage 2: loss 0.1", 0.5)
    assert "\n" not in stream.getvalue()  # an ordinary message stays in the bar
