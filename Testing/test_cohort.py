"""Cohorts: the task list, the GPU shares, the warm-up once per machine, and a cohort on a local Ray cluster."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from NeuralRaycastLib.app.cli import main
from NeuralRaycastLib.cohort.runner import budget_for_share, gpu_fraction, studies_per_gpu
from NeuralRaycastLib.cohort.tasks import TaskListError, read_task_list
from NeuralRaycastLib.gpu.memory_budget import GIB


def _study(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    return folder


def test_a_task_list_from_a_folder_csv_json_glob_or_generated_studies(tmp_path, monkeypatch):
    studies = tmp_path / "studies"
    for name in ("b", "a"):
        _study(studies / name)
    (studies / "notes").mkdir()  # neither manifest nor NIfTI: not a study
    folder = read_task_list(str(studies))
    assert [(t.name, t.study) for t in folder] == [("a", str(studies / "a")), ("b", str(studies / "b"))]
    monkeypatch.chdir(tmp_path)  # a worker's working folder is not the driver's: every path is absolute
    assert [t.study for t in read_task_list("studies")] == [str(studies / "a"), str(studies / "b")]
    assert [t.study for t in read_task_list("studies/[ab]")] == [str(studies / "a"), str(studies / "b")]

    listing = tmp_path / "list.csv"
    listing.write_text("study,name\nstudies/a,first\nstudies/b/manifest.json,\n")
    assert [(t.name, t.study) for t in read_task_list(str(listing))] == [
        ("first", str(studies / "a")), ("b", str(studies / "b" / "manifest.json"))]

    # Two studies of one name (BraTS cases in sites' folders) get names that stay the same on every rerun.
    _study(tmp_path / "site2" / "a")
    both = tmp_path / "list.json"
    both.write_text(json.dumps({"studies": [str(studies / "a"), {"path": "site2/a"}]}))
    names = [t.name for t in read_task_list(str(both))]
    assert len(set(names)) == 2 and all(n.startswith("a-") for n in names)
    assert names == [t.name for t in read_task_list(str(both))]

    matched = read_task_list(str(tmp_path / "s*" / "a"))
    assert [t.study for t in matched] == [str(tmp_path / "site2" / "a"), str(studies / "a")]

    generated = tmp_path / "generated.csv"  # pretraining data: one task per generated study
    generated.write_text("case,seed,spacing\nphantom,0,4\nphantom,1,4\n")
    tasks = read_task_list(str(generated))
    assert [(t.name, t.study, t.case, dict(t.options)) for t in tasks] == [
        ("phantom-seed0-spacing4", None, "phantom", {"seed": 0, "spacing": 4}),
        ("phantom-seed1-spacing4", None, "phantom", {"seed": 1, "spacing": 4})]


@pytest.mark.parametrize("listing, message", [
    ("missing", "not a folder of studies, a .csv or .json list, or a glob pattern"),
    ("empty", "no studies in this folder"),
    ("nothing*", "the pattern matches nothing"),
    ("bad.csv", "no 'study' (or 'path', or 'case') column"),
    ("bad.json", "not valid JSON"),
])
def test_a_task_list_that_cannot_be_read_is_one_line_and_status_2(listing, message, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.csv").write_text("file\nx\n")
    (tmp_path / "bad.json").write_text("[")
    assert main(["cohort", str(tmp_path / listing), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"neuralraycast cohort: error: {tmp_path / listing}") and message in error
    assert "\n" not in error and not (tmp_path / "out").exists()
    with pytest.raises(TaskListError):
        read_task_list(str(tmp_path / listing))


@pytest.mark.parametrize("option, message", [
    (["--studies-per-gpu", "0"], "--studies-per-gpu must be at least 1 (got 0)"),
    (["--cpus-per-study", "0"], "--cpus-per-study must be above 0 (got 0)"),
    (["--iterations", "0"], "iterations must be at least 1 (got 0)"),
])
def test_a_bad_cohort_option_is_one_line_and_status_2_before_any_work(option, message, tmp_path, capsys):
    _study(tmp_path / "studies" / "a")
    assert main(["cohort", str(tmp_path / "studies"), "--out", str(tmp_path / "out"), *option]) == 2
    assert capsys.readouterr().err.strip().startswith(f"neuralraycast cohort: error: {message}")
    assert not (tmp_path / "out").exists()


def test_without_ray_a_cohort_on_ray_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # as where Ray is not installed
    _study(tmp_path / "studies" / "a")
    assert main(["cohort", str(tmp_path / "studies"), "--out", str(tmp_path / "out"), "--gpus", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "neuralraycast cohort: error: Ray is not installed; install it with: pip install 'neuralraycast[cohort]' "
        "(or pip install 'ray[default]')")
    assert not (tmp_path / "out").exists()


def test_studies_share_a_gpu_as_their_budgets_allow():
    assert studies_per_gpu(None, 80 * GIB) == 1 and studies_per_gpu(4 * GIB, None) == 1
    assert studies_per_gpu(4 * GIB, 80 * GIB) == 15  # 76 GiB past the margin, 5 GiB a study with its process
    assert studies_per_gpu(100 * GIB, 80 * GIB) == 1
    assert gpu_fraction(1) == 1.0 and gpu_fraction(3) == 0.3333 and 3 * gpu_fraction(3) <= 1.0
    assert studies_per_gpu(budget_for_share(4, 80 * GIB), 80 * GIB) == 4


def test_the_kernels_are_warmed_up_once_per_machine_not_once_per_task(tmp_path, monkeypatch):
    """Tasks that start together on one machine: the first warms up under the lock, the others wait for it
    and find its stamp."""
    import NeuralRaycastLib.train.run_folder as run_folder
    import NeuralRaycastLib.train.warmup as warmup
    from NeuralRaycastLib.cohort.study_task import warm_up_once

    stamp = tmp_path / "warm-ups" / "kernels.json"
    warmed = []

    def ensure_warm(gpu, study, prepared, settings):
        time.sleep(0.3)
        warmed.append(study)
        stamp.write_text("{}")

    monkeypatch.setattr(run_folder, "study_within_budget", lambda study, settings, budget: (study, settings))
    monkeypatch.setattr(run_folder, "prepare_for_run", lambda study, settings: study)
    monkeypatch.setattr(warmup, "needs_warm_up", lambda gpu, prepared, settings: not stamp.exists())
    monkeypatch.setattr(warmup, "ensure_warm", ensure_warm)
    gpu = SimpleNamespace(report=SimpleNamespace(software=False, shader_cache=str(tmp_path)),
                          memory=SimpleNamespace(bytes=GIB, source="test"))
    tasks = [threading.Thread(target=warm_up_once, args=(gpu, f"study{i}", None)) for i in range(3)]
    for task in tasks:
        task.start()
    for task in tasks:
        task.join()
    assert len(warmed) == 1


def test_a_generated_study_is_written_whole_once_and_read_by_every_later_run(tmp_path):
    """Pretraining data: a task that names a sample case writes that study under the cohort's generated/ folder."""
    from NeuralRaycastLib.cohort.study_task import generated_study
    from NeuralRaycastLib.study.study import load_study

    listing = tmp_path / "generated.csv"
    listing.write_text("case,seed,spacing\nphantom,3,8\n")
    (task,) = read_task_list(str(listing))
    manifest = generated_study(tmp_path / "out", task)
    assert manifest == tmp_path / "out" / "generated" / "phantom-seed3-spacing8" / "manifest.json"
    written = manifest.stat().st_mtime_ns
    assert load_study(manifest).shape == load_study(generated_study(tmp_path / "out", task)).shape
    assert manifest.stat().st_mtime_ns == written
    assert sorted(p.name for p in (tmp_path / "out" / "generated").iterdir()) == ["phantom-seed3-spacing8"]


def test_a_second_cohort_run_into_the_same_folder_is_refused_while_the_first_runs(tmp_path, capsys):
    from NeuralRaycastLib.cohort.study_task import node_lock

    _study(tmp_path / "studies" / "a")
    out = tmp_path / "out"
    out.mkdir()
    with node_lock(out / "cohort.lock"):
        assert main(["cohort", str(tmp_path / "studies"), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"neuralraycast cohort: error: {out}: another cohort run is writing into this folder; wait for it to end, "
        "or choose another --out")
    assert sorted(p.name for p in out.iterdir()) == ["cohort.lock"]


def test_the_summary_page_draws_each_distribution_and_a_row_per_study(tmp_path):
    from NeuralRaycastLib.cohort.summary import histogram_svg, write_summary

    rows = [{"name": "a", "status": "done", "psnr": 30.0, "dice_mean": 0.9, "seconds": 20.0, "dice": {"brain": 0.9}},
            {"name": "b", "status": "done", "psnr": 40.0, "dice_mean": 0.8, "seconds": 30.0, "dice": {"brain": 0.8}},
            {"name": "c", "status": "failed", "error": "c: no such file or folder", "seconds": 0.1}]
    write_summary(tmp_path, rows, {"total": 3, "done": 2, "failed": 1, "elapsed": 50.0})
    page = (tmp_path / "summary.html").read_text()
    assert page.count("<svg") == 3 and "held-out PSNR: 2 studies, 30 to 40 dB" in page
    assert "<td>c: no such file or folder</td>" in page and "http" not in page.replace("http://www.w3.org", "")
    assert (tmp_path / "summary.csv").read_text().splitlines()[1].endswith(",0.9")  # dice_brain
    assert histogram_svg([19.98, 19.98001], "PSNR", "dB").count("<rect") == 1  # one value, one bar


@pytest.mark.gpu
def test_a_cohort_on_a_local_ray_cluster_trains_each_study_once_and_a_broken_one_fails_alone(tmp_path, capsys):
    """Three phantom studies on a CPU Ray cluster, one missing a channel's file: it fails with its one-line message
    and the others are trained whole; a rerun skips them, clears what a killed worker left, and completes."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'neuralraycast[cohort]')")
    from NeuralRaycastLib.study.sample import write_sample

    studies = tmp_path / "studies"
    write_sample(studies / "a", "phantom", spacing=4)  # the kernels test_cli's fit compiles
    shutil.copytree(studies / "a", studies / "b")
    shutil.copytree(studies / "a", studies / "broken")
    missing = studies / "broken" / "phantom_t2.nii.gz"
    kept = missing.rename(tmp_path / missing.name)
    out = tmp_path / "cohort"
    command = ["cohort", str(studies), "--out", str(out), "--preset", "quick", "--iterations", "12", "--views", "4",
               "--size", "32", "--ray-address", "local", "--cpus-per-study", "2"]  # one worker: one device to open
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert main(command) == 2
        captured = capsys.readouterr()
        assert captured.err.strip().splitlines()[-1] == (
            f"neuralraycast cohort: error: 1 of 3 studies failed (their errors are in {out / 'failed'} and "
            f"{out / 'summary.html'}); run the same command again to retry them (the studies done are skipped)")
        error = json.loads((out / "failed" / "broken" / "error.json").read_text())
        assert error["status"] == "failed" and error["error"] == f"{missing}: channel t2 file not found"
        assert "cohort: broken FAILED: " + error["error"] in captured.out
        for name in ("a", "b"):
            folder = out / "studies" / name
            assert {"run.json", "model.safetensors", "train_log.json", "metrics.json", "study.json",
                    "reference"} <= {p.name for p in folder.iterdir()}
            assert json.loads((folder / "study.json").read_text())["psnr"] > 10
        assert sorted(p.name for p in (out / "studies").iterdir()) == ["a", "b"]  # nothing half-written
        rows = (out / "summary.csv").read_text().splitlines()
        assert [row.split(",")[:2] for row in rows[1:]] == [["a", "done"], ["b", "done"], ["broken", "failed"]]
        assert "<svg" in (out / "summary.html").read_text()

        # A worker killed while training 'broken' left its staging folder; the study is fixed and run again.
        (out / "studies" / "broken.partial-0123456789ab").mkdir()
        (out / "studies" / "broken.partial-0123456789ab" / "model.safetensors").write_bytes(b"half")
        kept.rename(missing)
        trained = {name: (out / "studies" / name / "model.safetensors").stat().st_mtime_ns for name in ("a", "b")}
        assert main(command) == 0
        captured = capsys.readouterr()
        assert "cohort: 2 of 3 studies already done" in captured.out
        assert "cohort: 3 of 3 studies done (2 skipped), 0 failed" in captured.out
        assert trained == {name: (out / "studies" / name / "model.safetensors").stat().st_mtime_ns
                           for name in ("a", "b")}
        assert sorted(p.name for p in (out / "studies").iterdir()) == ["a", "b", "broken"]
        assert not (out / "failed" / "broken").exists()
        summary = json.loads((out / "summary.json").read_text())
        assert [row["status"] for row in summary["studies"]] == ["done", "done", "done"]
    finally:
        ray.shutdown()
