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


def test_a_task_list_from_a_folder_csv_json_glob_or_generated_studies(tmp_path):
    studies = tmp_path / "studies"
    for name in ("b", "a"):
        _study(studies / name)
    (studies / "notes").mkdir()  # neither manifest nor NIfTI: not a study
    folder = read_task_list(str(studies))
    assert [(t.name, t.study) for t in folder] == [("a", str(studies / "a")), ("b", str(studies / "b"))]

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
               "--size", "32", "--ray-address", "local"]
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
