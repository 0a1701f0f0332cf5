"""Cohorts: the task list, the GPU shares, the warm-up once per machine, a cohort on this machine's GPUs without Ray
(stand-in study processes), and one on a local Ray cluster."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
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
    (["--gpus", "0"], "--gpus without --ray-address must be at least 1 (got 0)"),
    (["--cpus", "4"], "--cpus sizes a local Ray cluster: add --ray-address local"),
    (["--gpus", "3"], "--gpus 3: this machine has 2 GPUs (CUDA_VISIBLE_DEVICES); give at most 2, or --gpus auto"),
])
def test_a_bad_cohort_option_is_one_line_and_status_2_before_any_work(option, message, tmp_path, capsys,
                                                                      monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # a machine (or a scheduler's share of it) of two GPUs
    _study(tmp_path / "studies" / "a")
    assert main(["cohort", str(tmp_path / "studies"), "--out", str(tmp_path / "out"), *option]) == 2
    assert capsys.readouterr().err.strip().startswith(f"neuralraycast cohort: error: {message}")
    assert not (tmp_path / "out").exists()


def test_without_ray_a_cohort_on_ray_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # as where Ray is not installed
    _study(tmp_path / "studies" / "a")
    assert main(["cohort", str(tmp_path / "studies"), "--out", str(tmp_path / "out"), "--ray-address", "local",
                 "--gpus", "2"]) == 2
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


def test_without_ray_the_slots_are_the_gpus_listed_in_turn_times_the_studies_per_gpu(monkeypatch):
    """A scheduler's CUDA_VISIBLE_DEVICES is the machine's GPUs; the first studies go to different GPUs; several
    per GPU without a budget share its memory."""
    from NeuralRaycastLib.cohort import runner
    from NeuralRaycastLib.cohort.study_task import FitOptions

    said = []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.setattr(runner, "_smallest_gpu_bytes", lambda: 80 * GIB)
    devices, options = runner.local_slots(runner.Cluster(gpus="auto", studies_per_gpu=2), FitOptions(), said.append)
    assert devices == ["3", "5", "3", "5"] and options.gpu_memory == str(budget_for_share(2, 80 * GIB))
    share = runner.format_bytes(int(options.gpu_memory))
    assert said == [f"cohort: 2 GPUs (CUDA_VISIBLE_DEVICES), 2 studies of {share} each per GPU: 4 at once, each in "
                    "a process of its own"]
    devices, _ = runner.local_slots(runner.Cluster(gpus=1), FitOptions(gpu_memory="30G"), said.append)
    assert devices == ["3", "3"]  # two studies of 30 GiB and their processes fit in 80 GB
    monkeypatch.setattr(runner, "machine_gpus", lambda: ([], "no nvidia-smi"))
    devices, _ = runner.local_slots(runner.Cluster(gpus="auto"), FitOptions(), said.append)
    assert devices == [None] and said[-1] == (
        "cohort: no GPU listed (no nvidia-smi): 1 study at once on this machine's device, each in a process of its own")


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
    and the others are trained whole; a rerun (without Ray) skips them, clears what a killed worker left, and
    completes."""
    import os

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

        # A worker killed while training 'broken' left its staging folder; the study is fixed and run again, on
        # this machine without Ray (a machine where Ray is not installed): in a process of its own.
        (out / "studies" / "broken.partial-0123456789ab").mkdir()
        (out / "studies" / "broken.partial-0123456789ab" / "model.safetensors").write_bytes(b"half")
        kept.rename(missing)
        trained = {name: (out / "studies" / name / "model.safetensors").stat().st_mtime_ns for name in ("a", "b")}
        without_ray = [part for part in command if part not in ("--ray-address", "local")] + ["--gpus", "1"]
        assert main(without_ray) == 0
        captured = capsys.readouterr()
        assert "1 study per GPU: 1 at once, each in a process of its own" in captured.out
        assert json.loads((out / "studies" / "broken" / "study.json").read_text())["pid"] != os.getpid()
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


#: A stand-in for a study's process: the real entry (study_process.main) with the training replaced by what the
#: study's name asks for, each step written to the trace folder.
STAND_IN = r'''
import errno, json, os, signal, subprocess, sys, time
from pathlib import Path
from NeuralRaycastLib.cohort import study_process, study_task

trace = Path(os.environ["COHORT_TRACE"])


def train(task, out, options, began):
    name = task.name
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # as the compilers are
    (trace / f"{name}.json").write_text(json.dumps({"gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
                                                    "pid": os.getpid(), "helper": helper.pid}))
    print("a library's own line on standard output")
    fixed = (trace / "fixed").exists()
    if name == "crash" and not fixed:
        print("GPU fault: device lost", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if name == "broken" and not fixed:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", f"{task.study}/t2.nii.gz")
    if name.startswith("hang"):
        time.sleep(120)
    if name in ("a", "b"):  # each waits for the other: they run at once, or time out alone
        other = trace / ("b.json" if name == "a" else "a.json")
        deadline = time.time() + 60
        while not other.exists():
            if time.time() > deadline:
                raise RuntimeError(f"{name} ran alone")
            time.sleep(0.05)
    record = {"name": name, "study": task.study, "status": "done", "psnr": 30.0, "seconds": 0.1,
              "pid": os.getpid()}
    folder = study_task.study_folder(out, name)
    folder.mkdir(parents=True)
    (folder / study_task.RECORD).write_text(json.dumps(record))
    helper.kill()
    return record


study_task._train = train
sys.exit(study_process.main())
'''


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch) -> Iterator[Path]:
    """Studies trained by :data:`STAND_IN` on a machine that lists no GPU; its trace folder. What a failing test
    left of its processes is ended after."""
    import sys

    from NeuralRaycastLib.cohort import local_gpus, runner

    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    trace = tmp_path / "trace"
    trace.mkdir()
    monkeypatch.setenv("COHORT_TRACE", str(trace))
    monkeypatch.setattr(local_gpus, "study_command", lambda: [sys.executable, str(script)])
    monkeypatch.setattr(runner, "machine_gpus", lambda: ([], "no nvidia-smi"))
    yield trace
    _end_left(trace)


def _end_left(trace: Path) -> None:
    """End what a failing test left of the stand-in's processes."""
    import contextlib
    import os
    import signal

    for path in trace.glob("*.json"):
        entry = json.loads(path.read_text())
        for pid in (entry["pid"], entry["helper"]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _ended(pid: int, seconds: float = 20.0) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``seconds``."""
    import os

    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        stat = Path(f"/proc/{pid}/stat")
        if stat.exists() and stat.read_text().rsplit(")", 1)[-1].split()[0] == "Z":
            return True
        time.sleep(0.05)
    return False


def test_without_ray_gpus_n_trains_a_study_per_gpu_at_once_each_in_its_own_process(tmp_path, stand_in, capsys):
    """--gpus 2 without Ray: two studies at once, each in a process seeing only its GPU; a study's own error and a
    process killed mid-study are one failed study each, with its one line, while the others finish; the summary
    counts them; a rerun trains only those two."""
    from NeuralRaycastLib.app.cli import describe_error

    trace = stand_in
    studies = tmp_path / "studies"
    for name in ("a", "b", "broken", "c", "crash"):
        _study(studies / name)
    out = tmp_path / "out"
    command = ["cohort", str(studies), "--out", str(out), "--gpus", "2"]
    assert main(command) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines()[-1] == (
        f"neuralraycast cohort: error: 2 of 5 studies failed (their errors are in {out / 'failed'} and "
        f"{out / 'summary.html'}); run the same command again to retry them (the studies done are skipped)")
    assert "cohort: 2 GPUs as given (none listed: no nvidia-smi), 1 study per GPU: 2 at once" in captured.out
    seen = {name: json.loads((trace / f"{name}.json").read_text()) for name in ("a", "b", "broken", "c", "crash")}
    assert {seen["a"]["gpu"], seen["b"]["gpu"]} == {"0", "1"}  # at once (each waited for the other), apart
    assert len({entry["pid"] for entry in seen.values()}) == 5  # a fresh process per study
    assert all(_ended(entry["helper"]) for entry in seen.values())  # the crashed one's helper too

    crash = json.loads((out / "failed" / "crash" / "error.json").read_text())
    assert crash["error"] == ("its process ended unexpectedly (signal SIGKILL); its last words: GPU fault: "
                              "device lost; run the cohort again to train it")
    assert "GPU fault: device lost" in crash["traceback"]
    assert f"cohort: crash FAILED: {crash['error']}" in captured.out
    missing = f"{studies / 'broken'}/t2.nii.gz"
    broken = json.loads((out / "failed" / "broken" / "error.json").read_text())
    assert broken["error"] == describe_error(FileNotFoundError(2, "No such file or directory", missing))
    summary = json.loads((out / "summary.json").read_text())
    assert [(row["name"], row["status"]) for row in summary["studies"]] == [
        ("a", "done"), ("b", "done"), ("broken", "failed"), ("c", "done"), ("crash", "failed")]
    assert {key: summary["progress"][key] for key in ("total", "done", "failed", "running", "waiting")} == {
        "total": 5, "done": 3, "failed": 2, "running": 0, "waiting": 0}
    assert sorted(p.name for p in (out / "studies").iterdir()) == ["a", "b", "c"]

    (trace / "fixed").touch()
    assert main(command) == 0
    captured = capsys.readouterr()
    assert "cohort: 3 of 5 studies already done" in captured.out
    assert "cohort: 5 of 5 studies done (3 skipped), 0 failed" in captured.out
    assert not (out / "failed" / "crash").exists() and not (out / "failed" / "broken").exists()


def test_a_study_process_gets_its_job_whole_from_a_command_run_with_python_m(monkeypatch):
    """`python -m NeuralRaycastLib.app.cli cohort`: the study's process words a failure with the command line's
    function, named by its module, not __main__; the task and options arrive as they were."""
    import sys

    from NeuralRaycastLib.app import cli
    from NeuralRaycastLib.cohort.study_process import job_argument, read_job
    from NeuralRaycastLib.cohort.study_task import FitOptions
    from NeuralRaycastLib.cohort.tasks import StudyTask

    def describe_error(error: BaseException) -> str:
        return str(error)

    describe_error.__module__, describe_error.__qualname__ = "__main__", "describe_error"
    monkeypatch.setitem(sys.modules, "__main__", SimpleNamespace(__spec__=SimpleNamespace(name=cli.__name__)))
    task = StudyTask("x", case="phantom", options=(("seed", 3), ("spacing", "1,1,5")))
    options = FitOptions(preset="quick", iterations=12, gpu_memory="4G", meshes=("vtp", "stl"), warm_up=False)
    assert read_job(job_argument(task, "/out", options, describe_error)) == (task, "/out", options,
                                                                             cli.describe_error)


@pytest.fixture
def python_interrupts() -> Iterator[None]:
    """Python's own Ctrl-C handling, as a terminal gives it, while the test runs: a suite started as a background job
    of a script begins with SIGINT ignored, and the interrupt would then never come. The handler found is put back."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupted_cohort_without_ray_ends_every_study_process_and_what_it_started(tmp_path, stand_in,
                                                                                         python_interrupts):
    """Ctrl-C while two studies train: both processes and their helpers end at once, no other study starts, and
    the output folder is free for the next run."""
    import signal

    from NeuralRaycastLib.cohort.runner import Cluster, run_cohort
    from NeuralRaycastLib.cohort.study_task import FitOptions, node_lock
    from NeuralRaycastLib.cohort.tasks import StudyTask

    trace = stand_in
    tasks = [StudyTask(f"hang{i}", study=str(tmp_path / f"hang{i}")) for i in range(3)]
    main_thread = threading.main_thread().ident

    def interrupt_once_both_started() -> None:
        deadline = time.time() + 60
        while len(list(trace.glob("*.json"))) < 2 and time.time() < deadline:
            time.sleep(0.05)
        signal.pthread_kill(main_thread, signal.SIGINT)

    threading.Thread(target=interrupt_once_both_started, daemon=True).start()
    began = time.time()
    with pytest.raises(KeyboardInterrupt):
        run_cohort(tasks, tmp_path / "out", FitOptions(), Cluster(gpus=2), echo=lambda line: None)
    assert time.time() - began < 60
    started = [json.loads(path.read_text()) for path in trace.glob("*.json")]
    assert len(started) == 2  # the third never started
    assert all(_ended(entry["pid"]) and _ended(entry["helper"]) for entry in started)
    with node_lock(tmp_path / "out" / "cohort.lock", wait=False) as held:
        assert held
