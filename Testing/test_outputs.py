"""Nothing lost, nothing half-written, on the output side: outputs checked before any work, file system and
memory errors as one line with what to do, a distinct exit status for a cancel, options checked against
their limits, and metrics that strict JSON parsers read (fault injection where a real fault cannot be made)."""

from __future__ import annotations

import errno
import gzip
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import NeuralRaycastLib.app.cli as cli
from NeuralRaycastLib import outputs
from NeuralRaycastLib.app.cli import main
from NeuralRaycastLib.outputs import OutputError, check_output
from NeuralRaycastLib.train import run as run_module
from NeuralRaycastLib.train.presets import RunSettings

ROOT = Path(__file__).resolve().parents[1]
RUN_FILES = ("run.json", "model.safetensors", "train_log.json")


class DeviceOpened(Exception):
    """A command got past its checks to open the device."""


@pytest.fixture
def no_device(monkeypatch):
    """The refusals here all come before the device opens: a command that gets that far stops the test at
    once (instead of training)."""

    from NeuralRaycastLib.app import demo

    def opened(*args, **kwargs):
        raise DeviceOpened

    monkeypatch.setattr(cli, "open_device", opened)
    monkeypatch.setattr(demo, "open_device", opened)


def fake_gpu() -> SimpleNamespace:
    return SimpleNamespace(backend="vulkan", report=SimpleNamespace(software=True, adapter="a CPU",
                                                                    as_text=lambda: "a CPU"))


def error_line(capsys) -> str:
    """Standard error's one line (and no traceback)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def last_line(capsys) -> str:
    """Standard error's last line (progress may come before it), and no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def write_run_folder(folder: Path, study: str | None, **settings) -> Path:
    """A run folder as ``fit`` leaves it (its model a stand-in: nothing here reads it)."""
    (folder / "reference" / "views").mkdir(parents=True)
    (folder / "reference" / "views" / "099.png").write_bytes(b"an old view")
    (folder / "run.json").write_text(json.dumps({"version": 1, "study": study,
                                                 "settings": {"preset": "quick", **settings}}))
    for name in ("model.safetensors", "train_log.json", "metrics.json"):
        (folder / name).write_text("{}")
    return folder


def reject_constant(name: str):
    raise ValueError(f"not strict JSON: {name}")


# --- output folders, checked before any work --------------------------------------------------------------

OUTPUT_COMMANDS = {
    "fit": lambda study, run, out: ["fit", study, "--out", out, "--preset", "quick"],
    "render-reference": lambda study, run, out: ["render-reference", study, "--out", out],
    "mesh": lambda study, run, out: ["mesh", study, "--out", out],
    "render": lambda study, run, out: ["render", run, "--out", out],
    "export": lambda study, run, out: ["export", run, "--out", out],
    "demo": lambda study, run, out: ["demo", "--out", out],
}


@pytest.mark.parametrize("command", OUTPUT_COMMANDS)
def test_an_existing_file_is_refused_as_an_output_folder_and_kept(command, tmp_path, phantom_study_dir, no_device,
                                                                  capsys):
    existing = tmp_path / "results.txt"
    existing.write_text("the user's notes")
    args = OUTPUT_COMMANDS[command](str(phantom_study_dir), str(tmp_path / "run"), str(existing))
    assert main(args) == 2
    assert error_line(capsys) == (f"neuralraycast {command}: error: {existing} is a file, not a folder; choose a "
                                  "folder name for the output")
    assert existing.read_text() == "the user's notes"


@pytest.mark.parametrize("where", ["the study", "inside the study", "around the study"])
def test_fit_never_writes_into_the_study_nor_around_it(where, tmp_path, no_device, capsys):
    """A run written into a study folder turned it into a run, which a later 'mesh STUDY' read as one."""
    from NeuralRaycastLib.study.sample import write_sample

    study = write_sample(tmp_path / "parent" / "study", "phantom", spacing=8.0).parent
    before = listing(tmp_path)
    out = {"the study": study, "inside the study": study / "run", "around the study": study.parent}[where]
    assert main(["fit", str(study / "manifest.json"), "--out", str(out), "--preset", "quick"]) == 2
    expected = {"the study": f"{out} is the input's own folder; choose an output folder outside it",
                "inside the study": f"{out} is inside the input folder {study}; choose an output folder outside it",
                "around the study": f"{out} contains the input {study / 'manifest.json'}; choose an output "
                                    "folder that does not contain it"}[where]
    assert error_line(capsys) == f"neuralraycast fit: error: {expected}"
    assert listing(tmp_path) == before


@pytest.mark.parametrize("command", OUTPUT_COMMANDS)
def test_a_non_empty_folder_is_refused_unless_overwrite_is_given(command, tmp_path, phantom_study_dir, no_device,
                                                                 capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's notes")
    args = OUTPUT_COMMANDS[command](str(phantom_study_dir), str(tmp_path / "run"), str(out))
    assert main(args) == 2
    assert error_line(capsys) == (f"neuralraycast {command}: error: {out} is not empty; choose a new or empty "
                                  "folder, or pass --overwrite to write over it")
    assert listing(out) == ["notes.txt"]
    if command in ("fit", "demo"):
        with pytest.raises(DeviceOpened):  # accepted: the work starts
            main([*args, "--overwrite"])
    if command in ("render-reference", "render"):  # --overwrite replaces earlier views, never other files
        assert main([*args, "--overwrite"]) == 2
        assert "holds other files" in error_line(capsys) and listing(out) == ["notes.txt"]


def test_fit_replaces_a_run_of_the_same_study_and_refuses_one_of_another(tmp_path, phantom_study_dir, no_device,
                                                                          capsys):
    """An earlier run of another study was written over, its metrics and extra views kept: a folder mixing two
    studies. A run of the same study (by its folder or its manifest) is what a new fit replaces."""
    other = write_run_folder(tmp_path / "other", "/elsewhere/study")
    before = listing(other)
    assert main(["fit", str(phantom_study_dir), "--out", str(other), "--preset", "quick"]) == 2
    assert error_line(capsys) == (f"neuralraycast fit: error: {other} is a run of another study (/elsewhere/study);"
                                  " choose a new or empty folder, or pass --overwrite to write over it")
    assert listing(other) == before
    same = write_run_folder(tmp_path / "same", str(phantom_study_dir / "manifest.json"))
    with pytest.raises(DeviceOpened):
        main(["fit", str(phantom_study_dir), "--out", str(same), "--preset", "quick"])
    assert check_output(same, phantom_study_dir, run_of=str(phantom_study_dir.resolve())) == same
    memory = write_run_folder(tmp_path / "memory", None)  # a Slicer scene's study: nothing to compare
    with pytest.raises(OutputError, match="is not empty"):
        check_output(memory, None, run_of=str(phantom_study_dir))


def test_a_run_folder_holding_a_file_of_the_users_is_refused_and_kept(tmp_path, phantom_study_dir, monkeypatch):
    """A run replaces an earlier run whole, so it never mixes two runs' files; a run folder in which the user
    put a file of their own is refused before any work, and nothing of it is touched."""
    folder = write_run_folder(tmp_path / "run", str(phantom_study_dir))
    (folder / "notes.txt").write_text("the user's notes")
    before = listing(folder)

    def no_work(*args, **kwargs):
        raise AssertionError("the study was prepared for a refused output")

    monkeypatch.setattr(run_module, "prepare_for_run", no_work)
    with pytest.raises(FileExistsError, match="holds other files"):
        run_module.train_study(fake_gpu(), phantom_study_dir, folder, RunSettings("quick"), warm_up=False)
    assert listing(folder) == before and (folder / "notes.txt").read_text() == "the user's notes"


@pytest.mark.parametrize("fault", [(errno.EROFS, "Read-only file system"), (errno.EACCES, "Permission denied")])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(fault, tmp_path, phantom_study_dir, no_device,
                                                                     monkeypatch, capsys):
    """Permission bits say nothing as root (these tests may run as root): a probe file is written, and its
    failure injected here."""
    def refuse(*args, **kwargs):
        raise OSError(fault[0], fault[1])

    monkeypatch.setattr(outputs.tempfile, "mkstemp", refuse)
    out = tmp_path / "new" / "run"
    assert main(["fit", str(phantom_study_dir), "--out", str(out), "--preset", "quick"]) == 2
    assert error_line(capsys) == (f"neuralraycast fit: error: cannot write in {tmp_path} ({fault[1]}); choose a "
                                  "writable folder for the output")
    assert listing(tmp_path) == []


# --- one line for every file system and memory error -------------------------------------------------------

@pytest.mark.parametrize(("error", "shown"), [
    (OSError(errno.ENOSPC, "No space left on device", "{out}/model.safetensors"),
     "{out}/model.safetensors: No space left on device; free some space there or choose another folder"),
    (OSError(errno.EROFS, "Read-only file system", "{out}/run.json"),
     "{out}/run.json: Read-only file system; choose a writable folder"),
    (PermissionError(errno.EACCES, "Permission denied", "{out}"),
     "{out}: Permission denied; check its permissions or choose a writable folder"),
    (MemoryError("Unable to allocate 6.60 GiB for an array with shape (1500, 1500, 1500)"),
     "not enough memory (Unable to allocate 6.60 GiB for an array with shape (1500, 1500, 1500)); close other "
     "programs, or use a smaller study or preset (--preset quick)"),
])
@pytest.mark.parametrize("command", ["export", "sample"])
def test_file_system_and_memory_errors_inside_a_command_are_one_line_with_what_to_do(
        command, error, shown, tmp_path, monkeypatch, capsys, caplog):
    from NeuralRaycastLib.study import sample
    from NeuralRaycastLib.train import run_folder

    out = tmp_path / "out"
    if isinstance(error, OSError):
        error = type(error)(error.errno, error.strerror, error.filename.format(out=out))

    def fails(*args, **kwargs):
        raise error

    monkeypatch.setattr(run_folder, "export_run", fails)
    monkeypatch.setattr(sample, "write_sample", fails)
    args = ["export", str(tmp_path / "run"), "--out", str(out)] if command == "export" else ["sample", str(out)]
    assert main(args) == 2
    assert error_line(capsys) == f"neuralraycast {command}: error: {shown.format(out=out)}"
    assert main(["--verbose", *args]) == 2  # the traceback, for a bug report, only when asked for
    assert "Traceback" in caplog.text


def test_a_message_of_several_lines_is_shown_on_one(tmp_path, phantom_study_dir, capsys):
    """A truncated image: the NIfTI reader's message spans two lines."""
    study = tmp_path / "study"
    shutil.copytree(phantom_study_dir, study)
    channel = study / "phantom_t1.nii.gz"
    data = gzip.decompress(channel.read_bytes())
    channel.write_bytes(gzip.compress(data[: len(data) // 2]))
    assert main(["prepare", str(study), "--no-cache"]) == 2
    line = error_line(capsys)
    assert line.startswith(f"neuralraycast prepare: error: {channel}: channel t1 data cannot be read (Expected ")
    assert "could the file be damaged?" in line


@pytest.mark.parametrize(("settings", "fault"), [
    ({"views": -3}, "bad value in the run description (views must be a whole number of at least 1 (got -3))"),
    ({"held_out_every": 1}, "bad value in the run description (held-out-every must be at least 2 (got 1))"),
    ({"iterations": 0}, "bad value in the run description (iterations must be at least 1 (got 0)"),
    ({"seed": "seven"}, "bad value in the run description (seed must be a whole number (got 'seven'))"),
    ({"preset": "fast"}, "bad value in the run description (unknown preset 'fast'"),
    ({"colour": "red"}, "damaged run description ("),
])
def test_a_bad_value_in_run_json_is_reported_naming_run_json(settings, fault, tmp_path, capsys):
    run = write_run_folder(tmp_path / "run", "/a/study", **settings)
    assert main(["export", str(run), "--out", str(tmp_path / "copy")]) == 2
    assert error_line(capsys).startswith(f"neuralraycast export: error: {run / 'run.json'}: {fault}")
    assert not (tmp_path / "copy").exists()


def test_a_run_trained_with_too_few_views_to_score_is_still_read(tmp_path):
    """Rendering and meshing it need no held-out view; its evaluation says what is missing."""
    from NeuralRaycastLib.train.run_folder import read_run

    assert read_run(write_run_folder(tmp_path / "run", "/a/study", views=2))["settings"].views == 2


# --- a cancel exits with its own status --------------------------------------------------------------------

def interrupt_me() -> None:
    """Ctrl-C, as the terminal sends it."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs in the main thread between instructions


def test_a_cancelled_fit_exits_130_and_says_where_its_state_is(tmp_path, phantom_study_dir, monkeypatch, capsys):
    from NeuralRaycastLib.train import run

    out = tmp_path / "run"

    def cancelled_training(gpu, study, folder, settings, progress, should_stop, **kwargs):
        interrupt_me()
        assert should_stop()  # Ctrl-C asked the training to stop; it keeps the state reached
        return SimpleNamespace(folder=Path(folder), log=SimpleNamespace(cancelled=True, seconds=2.5))

    monkeypatch.setattr(cli, "open_device", lambda device: fake_gpu())
    monkeypatch.setattr(run, "train_study", cancelled_training)
    assert main(["fit", str(phantom_study_dir), "--out", str(out), "--preset", "quick"]) == 130
    assert last_line(capsys) == (f"neuralraycast fit: cancelled after 2.5 s of training; the state reached is "
                                  f"saved in {out}")


CTRL_C_WHILE_LOADING = """
import importlib.abc, importlib.machinery, os, signal, sys, time

class SlowCommandLine(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # loading the command line is where a Ctrl-C lands in its first moment
    def find_spec(self, name, path, target=None):
        if name == "NeuralRaycastLib.app.cli":
            return importlib.machinery.ModuleSpec(name, self)
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)

sys.meta_path.insert(0, SlowCommandLine())
from NeuralRaycastLib.app.entry import main
sys.exit(main(["info"]))
"""


def test_ctrl_c_while_the_command_line_loads_exits_130_without_a_traceback():
    done = subprocess.run([sys.executable, "-c", CTRL_C_WHILE_LOADING], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 130 and done.stderr.strip() == "neuralraycast: cancelled", done.stderr


def test_a_fit_cancelled_before_training_exits_130_with_nothing_written(tmp_path, phantom_study_dir, monkeypatch,
                                                                         capsys):
    from NeuralRaycastLib.train import field_ahead, run

    def views_then_ctrl_c(*args):
        interrupt_me()
        return "views"

    monkeypatch.setattr(cli, "open_device", lambda device: fake_gpu())
    monkeypatch.setattr(run, "prepare_for_run", lambda study, settings, progress, gpu=None, with_outline=None,
                        before_maps=None: "prepared")
    monkeypatch.setattr(run.RunSettings, "field_layout", lambda self, gpu, prepared: "layout")
    monkeypatch.setattr(field_ahead, "check_run_fits", lambda budget, layout, prepared, config: None)
    monkeypatch.setattr(field_ahead, "NeuralField", lambda gpu, layout, seed: "field")
    monkeypatch.setattr(run, "reference_views_for_run", views_then_ctrl_c)
    out = tmp_path / "run"
    assert main(["fit", str(phantom_study_dir), "--out", str(out), "--preset", "quick", "--no-warmup"]) == 130
    assert last_line(capsys) == "neuralraycast fit: cancelled before training began; nothing was written"
    assert not out.exists()


def test_a_cancelled_demo_exits_130_after_saving_its_run_and_writes_no_report(tmp_path, monkeypatch, capsys):
    from NeuralRaycastLib.app import demo

    def cancelled_training(gpu, study, folder, settings, progress, should_stop, **kwargs):
        interrupt_me()
        assert should_stop()
        return SimpleNamespace(folder=Path(folder), log=SimpleNamespace(cancelled=True, seconds=1.0))

    monkeypatch.setattr(demo, "open_device", lambda device: fake_gpu())
    monkeypatch.setattr(demo, "train_study", cancelled_training)
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--case", "fixture"]) == 130
    assert last_line(capsys) == f"neuralraycast demo: cancelled; the state reached is saved in {out / 'run'}"
    assert not (out / "report.html").exists()


def test_the_help_lists_the_exit_statuses(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0 done; 2 bad input or environment" in text and "130 cancelled" in text


# --- options within their limits ---------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "message"), [
    (["fit", "{study}", "--iterations", "0"], "iterations must be at least 1 (got 0); leave it out for the preset's"),
    (["fit", "{study}", "--iterations", "-1"], "iterations must be at least 1 (got -1); leave it out for the preset's"),
    (["fit", "{study}", "--views", "1"], "views must be at least 4 when one view in 8 is held out (got 1): at "
                                         "least one view is held out for evaluation and one trains"),
    (["fit", "{study}", "--seed", "-1"], "seed must be at least 0 (got -1)"),
    (["render-reference", "{study}", "--views", "1", "--held-out-every", "2"],
     "views must be at least 2 when one view in 2 is held out (got 1): at least one view is held out for "
     "evaluation and one trains"),
    (["render-reference", "{study}", "--views", "3"],
     "views must be at least 4 when one view in 8 is held out (got 3): at least one view is held out for "
     "evaluation and one trains"),
    (["render-reference", "{study}", "--held-out-every", "1"], "held-out-every must be at least 2 (got 1)"),
    (["render", "{run}", "--views", "0"], "views must be at least 1 (got 0)"),
    (["demo", "--seed", "-1"], "seed must be at least 0 (got -1)"),
])
def test_options_out_of_their_limits_are_refused_and_leave_no_output_folder(args, message, tmp_path,
                                                                            phantom_study_dir, no_device, capsys):
    out = tmp_path / "out"
    args = [a.format(study=phantom_study_dir, run=tmp_path / "run") for a in args]
    assert main([*args, "--out", str(out)]) == 2
    assert error_line(capsys) == f"neuralraycast {args[0]}: error: {message}"
    assert not out.exists()


@pytest.mark.parametrize(("bad", "message"), [
    ({"views": 3}, "views must be at least 4"), ({"iterations": 0}, "iterations must be at least 1"),
    ({"iterations": -5}, "iterations must be at least 1"), ({"seed": -2}, "seed must be at least 0"),
    ({"held_out_every": 0}, "held-out-every must be at least 2"), ({"preset": "fast"}, "unknown preset 'fast'"),
])
def test_run_settings_out_of_their_limits_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        RunSettings(**{"preset": "quick", **bad}).check()


def test_run_settings_are_checked_where_training_takes_them(tmp_path, phantom_study_dir, monkeypatch):
    """The Slicer module and scripts reach the same checks through train_study."""
    assert RunSettings("quick", views=4).check() == RunSettings("quick", views=4)
    assert RunSettings("quick", views=2, held_out_every=2).check()  # one trains, one is held out

    def prepare(*args):
        raise AssertionError("prepared before the settings were checked")

    monkeypatch.setattr(run_module, "prepare_for_run", prepare)
    with pytest.raises(ValueError, match="iterations must be at least 1"):
        run_module.train_study(fake_gpu(), phantom_study_dir, tmp_path / "run", RunSettings("quick", iterations=0))
    assert not (tmp_path / "run").exists()


# --- honest metrics ----------------------------------------------------------------------------------------

def test_json_output_writes_what_is_not_a_number_as_null(capsys):
    cli._print_json({"heldout_psnr": math.inf, "heldout_ssim": math.nan, "rows": [1.5, -math.inf],
                     "nested": {"a": (math.nan, 2)}})
    printed = json.loads(capsys.readouterr().out, parse_constant=reject_constant)
    assert printed == {"heldout_psnr": None, "heldout_ssim": None, "rows": [1.5, None], "nested": {"a": [None, 2]}}


def test_metrics_json_is_strict_json_with_missing_scores_as_null(tmp_path, monkeypatch):
    from NeuralRaycastLib.train import evaluate, run_folder, trainer

    monkeypatch.setattr(trainer, "score_views", lambda *args: {"heldout_psnr": math.inf,
                                                               "heldout_ssim": math.nan})
    monkeypatch.setattr(evaluate, "geometry_metrics", lambda field, prepared: {
        "brain": {"dice": 0.0, "mean_surface_distance_mm": None, "hd95_mm": None}})
    (tmp_path / "model.safetensors").write_bytes(b"0" * 10)
    prepared = SimpleNamespace(study=SimpleNamespace(shape=(4, 4, 4)))
    metrics = run_folder.run_metrics(SimpleNamespace(backend="vulkan", report=SimpleNamespace(adapter="a CPU")),
                                     tmp_path, prepared, None, SimpleNamespace(held_out=[3]), RunSettings("quick"),
                                     renderer="renderer")
    written = json.loads((tmp_path / "metrics.json").read_text(), parse_constant=reject_constant)
    assert written["heldout_psnr"] is None and written["heldout_ssim"] is None
    assert written["mean_surface_distance_mm"] == {"brain": None} and written["hd95_mm"] == {"brain": None}
    assert metrics["dice"] == {"brain": 0.0}


def test_an_empty_learned_surface_has_no_surface_distance():
    """It was scored 0.10 mm next to Dice 0."""
    from conftest import phantom_prepared

    from NeuralRaycastLib.train.evaluate import geometry_metrics

    _, prepared = phantom_prepared(8.0)
    count = len(prepared.structures)
    nowhere = SimpleNamespace(distances=lambda points: np.full((len(points), count), 5.0, np.float32))
    for name, values in geometry_metrics(nowhere, prepared).items():
        shown = {key: values[key] for key in ("dice", "mean_surface_distance_mm", "hd95_mm")}
        assert shown == {"dice": 0.0, "mean_surface_distance_mm": None, "hd95_mm": None}, name
        assert values["learned_volume_ml"] == 0.0 and values["pieces_kept"] == 0, name  # nothing learned


def test_evaluate_shows_a_missing_distance_as_a_dash_and_null(tmp_path, monkeypatch, capsys):
    from NeuralRaycastLib.train import run_folder

    metrics = {"heldout_psnr": 31.25, "heldout_ssim": 0.9, "dice": {"brain": 0.98, "tumor_core": 0.0},
               "mean_surface_distance_mm": {"brain": 0.25, "tumor_core": None},
               "hd95_mm": {"brain": 0.5, "tumor_core": None},
               "label_volume_ml": {"brain": 1200.0, "tumor_core": 2.0},
               "learned_volume_ml": {"brain": 1212.0, "tumor_core": 0.0},
               "volume_difference_percent": {"brain": 1.0, "tumor_core": -100.0},
               "label_pieces": {"brain": 1, "tumor_core": 2}, "pieces_kept": {"brain": 1, "tumor_core": 0},
               "pieces_dropped": {"brain": [], "tumor_core": [
                   {"voxels": 9, "volume_ml": 1.5, "centre_ras": [1.0, 2.0, 3.0]},
                   {"voxels": 3, "volume_ml": 0.5, "centre_ras": [-4.0, 5.5, 6.0]}]}}
    monkeypatch.setattr(cli, "open_device", lambda device: fake_gpu())
    monkeypatch.setattr(run_folder, "evaluate_run", lambda gpu, folder, progress: metrics)
    assert main(["evaluate", str(tmp_path)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0] == "held-out PSNR 31.25 dB, SSIM 0.9000"
    assert rows[2].split() == ["brain", "0.980", "0.25", "0.50", "1200.00", "1212.00", "+1.0%", "1", "of", "1"]
    assert rows[3].split() == ["tumor_core", "0.000", "–", "–", "2.00", "0.00", "-100.0%", "0", "of", "2"]
    assert rows[4] == ("tumor_core: a piece of 9 voxels (1.500 ml) at RAS [1.0, 2.0, 3.0] mm is not in the "
                       "learned surface")  # every dropped piece said, largest first
    assert rows[5].startswith("tumor_core: a piece of 3 voxels")
    assert main(["evaluate", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out, parse_constant=reject_constant)["hd95_mm"]["tumor_core"] is None


def test_evaluate_says_the_exact_surfaces_ceiling_and_the_volume_left_out(tmp_path, monkeypatch, capsys):
    """On the phantom, each structure's line of what the exact surface itself scores against the label and the
    learned Dice as a fraction of it; and the volume of the small pieces left out of the label's volume."""
    from NeuralRaycastLib.train import run_folder

    metrics = {"heldout_psnr": 31.25, "heldout_ssim": 0.9, "dice": {"tumor_core": 0.88},
               "mean_surface_distance_mm": {"tumor_core": 0.2}, "hd95_mm": {"tumor_core": 0.3},
               "label_volume_ml": {"tumor_core": 9.13}, "learned_volume_ml": {"tumor_core": 9.14},
               "left_out_volume_ml": {"tumor_core": 0.326}, "volume_difference_percent": {"tumor_core": 0.1},
               "label_pieces": {"tumor_core": 10}, "pieces_kept": {"tumor_core": 1},
               "pieces_dropped": {"tumor_core": []},
               "exact_mean_distance_mm": {"tumor_core": 0.52}, "exact_hd95_mm": {"tumor_core": 1.18},
               "ceiling_dice": {"tumor_core": 0.9006}, "dice_of_ceiling": {"tumor_core": 0.9771},
               "ceiling_hd95_mm": {"tumor_core": 1.16}, "ceiling_volume_difference_percent": {"tumor_core": -2.45}}
    monkeypatch.setattr(cli, "open_device", lambda device: fake_gpu())
    monkeypatch.setattr(run_folder, "evaluate_run", lambda gpu, folder, progress: metrics)
    assert main(["evaluate", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert ("  tumor_core       Dice 0.901 (the learned 0.977 of it), HD95 1.16 mm, volume -2.5%\n" in out)
    assert "tumor_core 0.326 ml left out" in out
    del metrics["ceiling_dice"], metrics["left_out_volume_ml"]  # any study but the phantom; runs evaluated before
    assert main(["evaluate", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "exact surfaces themselves" not in out and "left out" not in out


def test_scoring_without_a_held_out_view_is_refused():
    from NeuralRaycastLib.render.reference_views import ReferenceViews
    from NeuralRaycastLib.train.trainer import score_views

    with pytest.raises(ValueError, match="no held-out view to score \\(of 3 views\\)"):
        score_views(None, ReferenceViews(cameras=[], images=[None] * 3, training=[0, 1, 2], held_out=[]), [])


# --- a signal at a random point of fit ---------------------------------------------------------------------

@pytest.mark.gpu
def test_fit_interrupted_at_a_random_point_leaves_its_run_whole_or_nothing(tmp_path):
    """Ctrl-C while 'fit' prepares, renders or trains: exit status 130 (or 0 where it had finished), one line
    and no traceback; the run folder complete or absent, never half-written. The run is the one of
    test_cli.py's test_fit_and_evaluate_a_run, so its kernels are compiled already."""
    from NeuralRaycastLib.study.sample import write_sample

    manifest = write_sample(tmp_path / "s", "phantom", spacing=4)
    draw = random.Random(62)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for attempt, delay in enumerate([draw.uniform(0.0, 0.5), draw.uniform(1.0, 6.0)]):
        out = tmp_path / f"run{attempt}"
        process = subprocess.Popen(
            [sys.executable, "-m", "NeuralRaycastLib.app.cli", "fit", str(manifest), "--preset", "quick",
             "--iterations", "12", "--views", "4", "--size", "32", "--out", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
        first = process.stderr.readline()  # it has started its work (its modules imported)
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=300)
        err = first + err
        assert "Traceback" not in err, err
        assert process.returncode in (0, 130), err
        last = err.strip().splitlines()[-1]
        if process.returncode == 130 and ("nothing was written" in last or last == "neuralraycast fit: cancelled"):
            assert not out.exists(), (delay, err)
            continue
        if process.returncode == 130:
            assert last.startswith("neuralraycast fit: cancelled after ") and last.endswith(f"saved in {out}"), err
        assert all((out / name).stat().st_size > 0 for name in RUN_FILES), (delay, err)
        assert json.loads((out / "run.json").read_text())["study"] == str(manifest.resolve())
        assert isinstance(json.loads((out / "train_log.json").read_text())["cancelled"], bool)
