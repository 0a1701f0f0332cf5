"""The command line: help everywhere, data as JSON, one-line errors with a non-zero status."""

from __future__ import annotations

import json
import os

import imageio.v3 as iio
import numpy as np
import pytest

from NeuralRaycastLib.app.cli import build_parser, main


@pytest.mark.parametrize("command", ["info", "cache", "sample", "prepare", "render-reference", "fit", "render",
                                     "mesh", "share", "bench", "warmup", "demo"])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: neuralraycast " + command in capsys.readouterr().out


@pytest.mark.parametrize("command", ["prepare", "fit"])
def test_missing_study_is_one_line_and_status_2(command, tmp_path, capsys):
    extra = ["--out", str(tmp_path / "run")] if command == "fit" else []
    assert main([command, "/no/such/study", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"neuralraycast {command}: error: /no/such/study: no such file or folder"
    assert not (tmp_path / "run").exists()


def test_sample_then_prepare_as_json_with_preview(tmp_path, capsys):
    assert main(["sample", str(tmp_path / "s"), "--case", "fixture"]) == 0
    manifest = capsys.readouterr().out.strip()
    assert manifest.endswith("manifest.json")
    assert main(["prepare", manifest, "--json", "--preview", str(tmp_path / "p.png")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["shape_ijk"] == [33, 41, 25]
    assert [s["name"] for s in summary["structures"]] == ["brain", "whole_tumor", "tumor_core", "enhancing_tumor"]
    assert all(s["volume_ml"] > 0 for s in summary["structures"])
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_info_json_reports_the_device(capsys):
    assert main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] in ("cuda", "vulkan") and report["adapter"]
    # whether the networks run on tensor cores here, and why not where they do not
    tensor_cores = report["tensor_cores"]
    if report["backend"] == "cuda":
        assert tensor_cores.startswith(("yes (compute capability", "no ("))
    else:
        assert tensor_cores == "no (CUDA only; the per-thread networks run here)"


def test_unknown_case_is_rejected_by_the_parser():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sample", "x", "--case", "mri"])


def test_render_reference_writes_views_cameras_and_arrays(tmp_path, capsys):
    assert main(["sample", str(tmp_path / "s"), "--case", "fixture"]) == 0
    manifest = capsys.readouterr().out.strip()
    out = tmp_path / "views"
    assert main(["render-reference", manifest, "--views", "9", "--size", "24", "20", "--out", str(out)]) == 0
    assert "9 views (1 held out)" in capsys.readouterr().out
    cameras = json.loads((out / "cameras.json").read_text())["cameras"]
    assert [c["split"] for c in cameras].count("held_out") == 1 and cameras[0]["size"] == [24, 20]
    arrays = np.load(out / "reference.npz")
    assert arrays["rgba"].shape == (9, 20, 24, 4) and arrays["rgba"][..., 3].max() > 0.5
    assert len(list((out / "views").glob("*.png"))) == 9 and (out / "contact_sheet.png").is_file()


def test_mesh_writes_one_file_per_structure_and_format(tmp_path, capsys):
    assert main(["sample", str(tmp_path / "s"), "--case", "fixture"]) == 0
    manifest = capsys.readouterr().out.strip()
    assert main(["mesh", manifest, "--out", str(tmp_path / "m"), "--formats", "vtp", "stl"]) == 0
    names = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert names == sorted(f"{s}.{f}" for s in ("brain", "whole_tumor", "tumor_core", "enhancing_tumor")
                           for f in ("vtp", "stl"))


def test_fit_and_evaluate_a_run(tmp_path, capsys):
    from NeuralRaycastLib.field.model_io import ModelFileError, StudyGeometry, load_model
    from NeuralRaycastLib.study.preprocess import prepare
    from NeuralRaycastLib.study.sample import write_sample
    from NeuralRaycastLib.study.study import load_study

    # The phantom's structures and channels, as the Slicer module's end-to-end test: one set of kernels.
    assert main(["sample", str(tmp_path / "s"), "--case", "phantom", "--spacing", "4"]) == 0
    manifest = capsys.readouterr().out.strip()
    run = tmp_path / "run"
    assert main(["fit", manifest, "--preset", "quick", "--iterations", "12", "--views", "4", "--size", "32",
                 "--out", str(run)]) == 0
    printed = capsys.readouterr().out
    assert "held-out PSNR" in printed
    assert {"run.json", "model.safetensors", "train_log.json", "reference"} <= {p.name for p in run.iterdir()}
    # The views trained on, as pictures with their cameras; not their float arrays (seconds to compress).
    assert (run / "reference" / "cameras.json").is_file() and not (run / "reference" / "reference.npz").exists()
    # Where the run's time went, phase by phase: printed at the end, kept in the log (its save excepted).
    timing = next(line for line in printed.splitlines() if line.startswith("time: "))
    for phase in ("load", "boundary maps", "field", "reference views", "trainer", "train", "save"):
        assert f" {phase} " in f" {timing} ", timing
    phases = json.loads((run / "train_log.json").read_text())["phases"]
    assert [p["name"] for p in phases][:2] == ["load", "boundary maps"] and phases[-1]["name"] == "picture settings"
    assert all(p["seconds"] >= 0 for p in phases)
    assert main(["evaluate", str(run), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["heldout_psnr"] > 10 and 0 <= metrics["heldout_ssim"] <= 1
    assert set(metrics["dice"]) == {"brain", "whole_tumor", "tumor_core", "enhancing_tumor"}
    assert metrics["dice"]["brain"] > 0.5  # a few geometry steps already find the brain
    assert metrics["model_bytes"] == (run / "model.safetensors").stat().st_size

    # A float16 copy: half the file, the same scores to within its rounding.
    half = tmp_path / "run-half"
    assert main(["export", str(run), "--out", str(half)]) == 0
    assert "float16" in capsys.readouterr().out
    assert main(["evaluate", str(half), "--json"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported["model_bytes"] < 0.55 * metrics["model_bytes"]
    assert exported["heldout_psnr"] == pytest.approx(metrics["heldout_psnr"], abs=0.5)
    for name, dice in metrics["dice"].items():
        assert exported["dice"][name] == pytest.approx(dice, abs=0.01), name
    assert main(["export", str(run), "--out", str(half)]) == 2  # never over an existing folder
    assert "not empty" in capsys.readouterr().err
    (half / "metrics.json").write_text("{}")  # the old copy's, which the new one does not keep
    assert main(["export", str(run), "--out", str(half), "--overwrite"]) == 0  # unless told to replace the run
    assert not (half / "metrics.json").exists() and (half / "model.safetensors").stat().st_size == \
        exported["model_bytes"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("run-half")) == ["run-half"]

    # The trained field renders from new cameras and meshes its learned surfaces.
    assert main(["render", str(run), "--views", "2", "--size", "24", "20", "--out", str(tmp_path / "r")]) == 0
    picture = iio.imread(tmp_path / "r" / "views" / "001.png")
    assert picture.shape[:2] == (20, 24) and picture[..., :3].max() > 20
    assert (tmp_path / "r" / "depth" / "001.png").exists() and (tmp_path / "r" / "contact_sheet.png").exists()
    assert main(["mesh", str(run), "--out", str(tmp_path / "m"), "--formats", "stl"]) == 0
    assert (tmp_path / "m" / "brain.stl").stat().st_size > 1000
    capsys.readouterr()
    # The same kernels, all from the cache now; in worker processes, one per part of a run.
    assert main(["warmup", manifest, "--preset", "quick", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "SDF fit (stage 1)" in out and "joint backward" in out and "all parts (2 processes)" in out
    geometry = StudyGeometry.from_prepared(prepare(load_study(manifest)))
    model = load_model(run / "model.safetensors", geometry)
    assert model.parameters.size == model.layout.count
    other = prepare(load_study(write_sample(tmp_path / "other", "fixture")))  # another grid and channels
    with pytest.raises(ModelFileError):
        load_model(run / "model.safetensors", StudyGeometry.from_prepared(other))


def test_a_failing_warm_up_worker_is_reported_with_its_error(tmp_path):
    from NeuralRaycastLib.train.presets import RunSettings
    from NeuralRaycastLib.train.warmup import _parts_in_processes

    with pytest.raises(RuntimeError, match="warm-up failed in fit: .*missing"):
        _parts_in_processes(tmp_path / "missing.nii.gz", RunSettings("quick"), None, 3, lambda *_: None)


def test_a_cancelled_warm_up_stops_its_workers(tmp_path, monkeypatch):
    """While the parts compile (minutes) progress keeps coming; a cancel (Slicer's Cancel button) kills every
    worker and says so."""
    from NeuralRaycastLib.train import warmup
    from NeuralRaycastLib.train.presets import RunSettings
    from NeuralRaycastLib.train.warmup import WarmUpCancelled, _parts_in_processes

    pids = tmp_path / "pids"
    worker = tmp_path / "python"  # stands in for the interpreter: notes its process and waits
    worker.write_text(f"#!/bin/sh\necho $$ >> {pids}\nexec sleep 60\n")
    worker.chmod(0o755)
    polls = []

    reports = []

    def should_stop() -> bool:  # once all four side-by-side workers run and progress came (or after 10 s)
        polls.append(1)
        return (pids.exists() and len(pids.read_text().split()) == 4 and bool(reports)) or len(polls) > 200

    monkeypatch.setattr(warmup, "REPORT_EVERY_S", 0.0)
    with pytest.raises(WarmUpCancelled, match="nothing was trained"):
        _parts_in_processes("study", RunSettings("standard"), None, 4, lambda message, fraction: reports.append(
            message), should_stop, str(worker))
    parts = len(warmup.PARTS)
    assert reports and reports[-1].startswith(f"0 of {parts} parts compiled, 4 compiling")  # alive while it compiles
    started = [int(pid) for pid in pids.read_text().split()]
    assert len(started) == 4
    for pid in started:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_study_held_in_memory_warms_up_through_a_smaller_stand_in_with_the_same_kernels(
        monkeypatch, tmp_path, phantom_study_dir, capsys):
    """Slicer's study is in its scene, not a file: the warm-up's workers read a downsampled copy with the same
    structures and channels (the kernels depend on those counts), or the whole study where a structure would
    be lost; where nothing can be written the run compiles itself; on a machine that has compiled these
    kernels nothing is written or run."""
    from types import SimpleNamespace

    from NeuralRaycastLib.study.study import Study, load_study
    from NeuralRaycastLib.train import warmup
    from NeuralRaycastLib.train.presets import RunSettings
    from NeuralRaycastLib.train.run_folder import prepare_for_run

    study = load_study(phantom_study_dir)
    monkeypatch.setattr(warmup, "STAND_IN_VOXELS", max(study.shape) // 2)
    settings = RunSettings("standard")
    prepared = prepare_for_run(study, settings)
    gpu = SimpleNamespace(backend="cuda", report=SimpleNamespace(
        software=False, shader_cache=str(tmp_path / "cache"), slangpy_version="0.43.1", adapter="a GPU"))
    seen = []

    def warm_up_before_run(gpu, path, settings, progress, should_stop, python):
        seen.append((load_study(path), python, should_stop, settings))
        return {"all parts": 1.0}

    monkeypatch.setattr(warmup, "_warm_up_before_run", warm_up_before_run)
    stop = lambda: False  # noqa: E731
    assert warmup.ensure_warm(gpu, study, prepared, settings, should_stop=stop, python="PythonSlicer")
    stand_in, python, should_stop, used = seen[-1]
    assert max(stand_in.shape) <= warmup.STAND_IN_VOXELS < max(study.shape)
    assert stand_in.channel_names == study.channel_names and stand_in.structures == study.structures
    # its field sized for the study's voxels, as the run's; the kernels would be the same for its own voxels,
    # which make another number of the hash grid's levels dense (the kernels are told it at run time)
    assert used.field_voxel_mm == float(prepared.spacing.min())
    own = settings.field_layout(gpu, prepare_for_run(stand_in, settings))
    assert own.dense_levels != settings.field_layout(gpu, prepared).dense_levels
    assert (warmup.kernels_key(gpu, prepare_for_run(stand_in, used), used)
            == warmup.kernels_key(gpu, prepared, settings)
            == warmup.kernels_key(gpu, prepare_for_run(stand_in, settings), settings))
    assert python == "PythonSlicer" and should_stop is stop

    def disk_full(study, folder):
        raise OSError(28, "No space left on device")

    write_study = warmup.write_study
    monkeypatch.setattr(warmup, "write_study", disk_full)
    assert warmup.ensure_warm(gpu, study, prepared, settings) is None and len(seen) == 1
    assert "the run compiles its kernels itself" in capsys.readouterr().err
    monkeypatch.setattr(warmup, "write_study", write_study)

    def loses_a_structure(study: Study, voxels: int) -> Study:
        labels = study.labels.copy()
        labels[np.isin(labels, study.structures[next(reversed(study.structures))])] = 0
        return Study(study.name, study.channels, study.affine, labels, structures=study.structures)

    monkeypatch.setattr(warmup, "downsample_study", loses_a_structure)
    warmup.ensure_warm(gpu, study, prepared, settings)
    assert seen[-1][0].shape == study.shape  # the whole study instead

    stamp = warmup.warm_up_stamp(gpu, prepared, settings)
    stamp.parent.mkdir(parents=True)
    stamp.write_text("{}")
    assert warmup.ensure_warm(gpu, study, prepared, settings) is None and len(seen) == 2


def test_the_fit_forward_and_backward_parts_compile_side_by_side_and_the_joint_step_after_them(monkeypatch):
    """The SDF fit, the forward passes and the joint backward's two passes compile in processes side by side;
    the joint step's process starts only once all four have ended (it then finds their kernels cached).
    Workers are stand-ins here: the order is what is checked, with even five processes allowed, and that each
    is told the voxel size its field is sized for (a stand-in's study's)."""
    from NeuralRaycastLib.train import warmup
    from NeuralRaycastLib.train.presets import RunSettings

    events: list[tuple[str, str]] = []
    commands: list[list[str]] = []
    polls_to_finish = {"fit": 8, "appearance": 2, "backward-distances": 5, "backward-surface": 3, "joint": 2,
                       "pretrained": 4}

    class Worker:
        def __init__(self, command, **_):
            self.part, self.polls, self.returncode = command[4], 0, 0
            events.append(("start", self.part))
            commands.append(command)

        def poll(self):
            self.polls += 1
            if self.polls < polls_to_finish[self.part]:
                return None
            if ("end", self.part) not in events:
                events.append(("end", self.part))
            return 0

        def kill(self):
            pass

        def wait(self):
            return self.returncode

    monkeypatch.setattr(warmup.subprocess, "Popen", Worker)
    monkeypatch.setattr(warmup.time, "sleep", lambda seconds: None)
    settings = RunSettings("standard", field_voxel_mm=0.75)
    seconds = warmup._parts_in_processes("study", settings, None, 5, lambda *_: None)
    assert all(command[command.index("--field-voxel-mm") + 1] == "0.75" for command in commands)
    before_joint = ("fit", "appearance", "backward-distances", "backward-surface")
    first_end = min(index for index, (kind, _) in enumerate(events) if kind == "end")
    assert {("start", part) for part in before_joint} <= set(events[:first_end])
    assert events.index(("start", "joint")) > max(events.index(("end", part))
                                                  for part in before_joint)
    assert set(warmup.PARTS.values()) <= set(seconds)


def test_a_warm_up_on_a_gpu_compiles_each_part_in_a_process_of_its_own_even_one_at_a_time(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from NeuralRaycastLib.train import warmup
    from NeuralRaycastLib.train.presets import RunSettings

    calls = []
    monkeypatch.setattr(warmup, "prepare_for_run", lambda study, settings: "prepared")
    monkeypatch.setattr(warmup, "tiny_views", lambda gpu, prepared: "views")
    monkeypatch.setattr(warmup, "warm_up_part", lambda *args: calls.append(("here", args[-1])))
    monkeypatch.setattr(warmup, "_parts_in_processes", lambda study, settings, device, jobs, report, *_:
                        calls.append(("processes", device, jobs)) or {})
    monkeypatch.setattr(warmup, "warm_up_stamp", lambda gpu, prepared, settings: tmp_path / f"{gpu.name}.json")
    for software in (False, True):
        gpu = SimpleNamespace(name=f"software-{software}", backend="vulkan", report=SimpleNamespace(software=software))
        warmup.warm_up(gpu, "study", RunSettings("standard"), jobs=1)
    assert calls == [("processes", "vulkan", 1), *[("here", part) for part in warmup.PARTS]]  # workers open its backend
    assert {p.name for p in tmp_path.iterdir()} == {"software-False.json", "software-True.json"}  # stamps left


def test_fit_and_demo_on_a_gpu_warm_up_first_once_until_their_kernels_change(monkeypatch, tmp_path, capsys):
    """Compiled in the run's own process, one after another, a fresh GPU machine's kernels take far longer
    than in a warm-up's processes side by side: `fit` and `demo` run the warm-up first where this machine
    has no stamp of one for the run's kernels (shader sources, network sizes, preset, shadows, device). A
    software device compiles in the run either way; a failed warm-up is reported and the run goes on."""
    import shutil
    from dataclasses import replace
    from types import SimpleNamespace

    from conftest import phantom_prepared

    from NeuralRaycastLib.paths import SHADERS_ENV, shader_dir
    from NeuralRaycastLib.train import warmup
    from NeuralRaycastLib.train.presets import RunSettings

    shaders = tmp_path / "shaders"
    shutil.copytree(shader_dir(), shaders)
    monkeypatch.setenv(SHADERS_ENV, str(shaders))
    _, prepared = phantom_prepared(8.0)
    warm_ups = []
    monkeypatch.setattr(warmup, "prepare_for_run", lambda study, settings: prepared)
    monkeypatch.setattr(warmup, "tiny_views", lambda gpu, prepared: "views")
    monkeypatch.setattr(warmup, "_parts_in_processes",
                        lambda study, settings, device, jobs, report, *_: warm_ups.append(settings) or {"all": 1.0})

    def device(software: bool):
        return SimpleNamespace(backend="vulkan" if software else "cuda", report=SimpleNamespace(
            software=software, shader_cache=str(tmp_path / "cache"), slangpy_version="0.43.1", adapter="a GPU"))

    gpu, settings = device(False), RunSettings("standard")
    messages = []
    assert warmup.ensure_warm(gpu, "study", prepared, settings, lambda message, fraction: messages.append(message))
    assert len(warm_ups) == 1 and messages  # its progress says why the run waits
    assert all(message.startswith("compiling kernels (once per machine): ") for message in messages)
    assert warmup.warm_up_stamp(gpu, prepared, settings).exists()
    assert warmup.ensure_warm(gpu, "study", prepared, settings) is None and len(warm_ups) == 1  # stamped
    with open(shaders / "composite.slang", "a") as source:
        source.write("\n// an update\n")
    assert warmup.ensure_warm(gpu, "study", prepared, settings) is not None and len(warm_ups) == 2  # new kernels
    shadows = replace(settings, shadows=True)
    assert warmup.ensure_warm(gpu, "study", prepared, shadows) is not None and len(warm_ups) == 3
    assert warmup.ensure_warm(device(True), "study", prepared, settings) is None and len(warm_ups) == 3

    def fails(*args):
        raise RuntimeError("warm-up failed in fit: out of memory")

    monkeypatch.setattr(warmup, "_parts_in_processes", fails)
    quick = RunSettings("quick")
    assert warmup.ensure_warm(gpu, "study", prepared, quick) is None
    assert "warning: the warm-up failed (warm-up failed in fit: out of memory)" in capsys.readouterr().err
    assert not warmup.warm_up_stamp(gpu, prepared, quick).exists()  # tried again next time


@pytest.mark.parametrize("flags", [[], ["--no-warmup"]])
def test_fit_asks_for_the_warm_up_before_training_unless_told_not_to(flags, tmp_path, capsys, monkeypatch):
    """The warm-up gets the study as the run prepared it (nothing prepared twice), before any training."""
    from NeuralRaycastLib.study.preprocess import PreparedStudy
    from NeuralRaycastLib.train import run

    calls = []

    class Stop(Exception):
        pass

    def reference_views(gpu, prepared, *args, **kwargs):
        calls.append(("train", prepared))
        raise Stop

    monkeypatch.setattr(run, "ensure_warm",
                        lambda gpu, study, prepared, settings, *rest: calls.append(("warm-up", prepared)))
    monkeypatch.setattr(run, "reference_views_for_run", reference_views)
    assert main(["sample", str(tmp_path / "s"), "--case", "phantom", "--spacing", "4"]) == 0
    manifest = capsys.readouterr().out.strip()
    with pytest.raises(Stop):
        main(["fit", manifest, "--out", str(tmp_path / "run"), "--preset", "quick", *flags])
    assert [step for step, _ in calls] == (["train"] if flags else ["warm-up", "train"])
    assert isinstance(calls[0][1], PreparedStudy) and all(prepared is calls[0][1] for _, prepared in calls)


def test_json_output_stays_json_when_native_code_prints(capfd, monkeypatch):
    """Scripts parse `--json` output: what native libraries write to file descriptor 1 meanwhile (the shader
    compiler's warnings do) goes to standard error instead."""
    import os

    import NeuralRaycastLib.app.cli as cli

    def noisy_info(args):
        os.write(1, b"warning[E41035]: from native code\n")
        cli._print_json({"device": "checked"})
        return 0

    monkeypatch.setattr(cli, "cmd_info", noisy_info)
    assert main(["info", "--json"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out) == {"device": "checked"}
    assert "from native code" in err
    print("after")  # standard output is back
    assert capfd.readouterr().out == "after\n"


def test_cache_lists_its_folders_and_clears_only_those_named(tmp_path, monkeypatch, capsys):
    """Users see what the cache holds and free the space of the folders they name; others stay."""
    from NeuralRaycastLib.paths import CACHE_ENV, CACHE_FOLDERS
    from NeuralRaycastLib.study.cache import load_study_cached

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    assert main(["sample", str(tmp_path / "s"), "--case", "fixture"]) == 0
    load_study_cached(capsys.readouterr().out.strip())  # one study entry
    (tmp_path / "cache" / "views" / "a").mkdir(parents=True)
    (tmp_path / "cache" / "views" / "a" / "rgba.npy").write_bytes(b"x" * 1000)

    assert main(["cache", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    folders = {f["name"]: f for f in listed["folders"]}
    assert list(folders) == list(CACHE_FOLDERS) and listed["cache"] == str(tmp_path / "cache")
    assert folders["studies"]["entries"] == 1 and folders["studies"]["bytes"] > 10_000
    assert (folders["views"]["entries"], folders["views"]["bytes"]) == (1, 1000)
    assert listed["total_bytes"] == sum(f["bytes"] for f in folders.values())

    assert main(["cache", "--clear", "views"]) == 0
    assert capsys.readouterr().out.startswith("cleared views in ")
    assert not (tmp_path / "cache" / "views").exists()
    assert (tmp_path / "cache" / "studies").is_dir()
    assert main(["cache", "--clear", "all", "--json"]) == 0
    left = sum(f["bytes"] for name, f in folders.items() if name != "views")
    assert json.loads(capsys.readouterr().out)["freed_bytes"] == left
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == []
    assert main(["cache"]) == 0
    assert "total" in capsys.readouterr().out


@pytest.fixture(scope="module")
def phantom_manifest(tmp_path_factory) -> str:
    """The phantom at 4 mm, the study test_fit_and_evaluate_a_run trains on (the same kernels)."""
    from NeuralRaycastLib.study.sample import write_sample

    return str(write_sample(tmp_path_factory.mktemp("phantom4"), "phantom", spacing=4))


def test_fit_render_evaluate_and_mesh_within_a_small_gpu_memory_budget(phantom_manifest, tmp_path, capsys):
    """Under --gpu-memory 32M a run trains with fewer patches a step, says so, and logs the sizes it chose
    (fewer rays a rendered band than the device's default); every command that uses the GPU takes the budget."""
    from NeuralRaycastLib.gpu.memory_budget import SHARES, SOFTWARE_BYTES
    from NeuralRaycastLib.render.neural_render import BAND_BYTES
    from NeuralRaycastLib.render.sample_buffers import RayBatch

    run = tmp_path / "run"
    assert main(["fit", phantom_manifest, "--preset", "quick", "--iterations", "12", "--views", "4", "--size", "32",
                 "--gpu-memory", "32M", "--out", str(run)]) == 0
    captured = capsys.readouterr()
    assert "a GPU memory budget of 32 MiB (--gpu-memory) holds 2 of the preset's 4 patches a step (512 rays): " \
           "training takes smaller steps" in captured.err
    assert "held-out PSNR" in captured.out
    memory = json.loads((run / "train_log.json").read_text())["memory"]
    assert memory["budget_bytes"] == 32 << 20 and memory["budget_source"] == "--gpu-memory"
    assert (memory["preset_patches"], memory["patches"]) == (4, 2)
    per_ray = RayBatch.bytes_per_ray(192, 4)  # the quick preset's samples, the phantom's four structures
    share = int((32 << 20) * SHARES["band"])
    # sized by the samples the held-out views' rays took: more rays than at max_samples a ray, within the share
    assert share // per_ray <= memory["band_rays"] < share // RayBatch.RAY_BYTES
    assert memory["band_rays"] < min(BAND_BYTES[2], SOFTWARE_BYTES * SHARES["band"]) // per_ray
    for command in (["render", str(run), "--views", "1", "--size", "24", "20", "--out", str(tmp_path / "r")],
                    ["evaluate", str(run), "--json"], ["mesh", str(run), "--out", str(tmp_path / "m")]):
        assert main([*command, "--gpu-memory", "32M"]) == 0, command
    assert (tmp_path / "r" / "views" / "000.png").is_file() and (tmp_path / "m" / "brain.vtp").is_file()


def test_a_budget_no_run_fits_is_one_line_saying_what_to_lower_and_writes_nothing(phantom_manifest, tmp_path, capsys):
    run = tmp_path / "runs" / "run"
    assert main(["fit", phantom_manifest, "--preset", "quick", "--views", "4", "--size", "32", "--gpu-memory", "8M",
                 "--out", str(run)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1
    assert errors[0].startswith("neuralraycast fit: error: a GPU memory budget of 8 MiB (--gpu-memory) cannot hold "
                                "this run: the field and the study's volumes take ")
    for what in ("raise --gpu-memory", "--preset quick", "--size", "--max-voxels"):
        assert what in errors[0]
    assert not run.exists()
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []  # nor a staging folder


@pytest.mark.parametrize(("arguments", "variable", "expected"), [
    (["fit", "STUDY", "--out", "RUN", "--gpu-memory", "6X"], None,
     "neuralraycast fit: error: --gpu-memory: '6X' is not an amount of memory; write it as 6G, 6GiB or 6000M "
     "(or auto)"),
    (["render", "RUN", "--out", "RUN", "--gpu-memory", "0"], None,
     "neuralraycast render: error: --gpu-memory: 0 is less than the smallest budget, 1 MiB; write it as 6G, 6GiB "
     "or 6000M"),
    (["info"], "plenty",
     "neuralraycast info: error: $NEURALRAYCAST_GPU_MEMORY: 'plenty' is not an amount of memory; write it as 6G, "
     "6GiB or 6000M (or auto)"),
])
def test_a_bad_gpu_memory_amount_is_one_line_and_status_2(arguments, variable, expected, tmp_path, capsys,
                                                         monkeypatch):
    from NeuralRaycastLib.gpu.memory_budget import GPU_MEMORY_ENV

    if variable is not None:
        monkeypatch.setenv(GPU_MEMORY_ENV, variable)
    arguments = [str(tmp_path / a.lower()) if a in ("STUDY", "RUN") else a for a in arguments]
    assert main(arguments) == 2
    assert capsys.readouterr().err.strip() == expected
    assert list(tmp_path.iterdir()) == []


def test_info_says_the_budget_and_where_it_comes_from(capsys, monkeypatch):
    from NeuralRaycastLib.gpu.memory_budget import GPU_MEMORY_ENV

    monkeypatch.setenv(GPU_MEMORY_ENV, "3G")
    assert main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["memory_budget_bytes"], report["memory_budget_source"]) == (3 << 30, f"${GPU_MEMORY_ENV}")
    assert main(["info", "--gpu-memory", "1500M"]) == 0
    assert "memory budget      a GPU memory budget of 1.5 GiB (--gpu-memory)" in capsys.readouterr().out
    monkeypatch.delenv(GPU_MEMORY_ENV)
    assert main(["info"]) == 0  # each command its own budget: the device's here
    shown = capsys.readouterr().out
    assert "memory budget      a GPU memory budget of " in shown and "--gpu-memory" not in shown
    assert GPU_MEMORY_ENV not in shown
