"""Training in a worker process (NeuralRaycastLib/app/worker.py), with a plain ``python`` standing in for
PythonSlicer: the progress stream read, a stop request, the process tree ended, a killed worker reported."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from NeuralRaycastLib.app.worker import Outcome, WorkerProcess, progress_event

ROOT = Path(__file__).resolve().parents[1]
posix_only = pytest.mark.skipif(os.name == "nt", reason="process groups and signals as on POSIX")


def python_worker(script: str, *args: str) -> WorkerProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return WorkerProcess([sys.executable, "-c", textwrap.dedent(script), *args], env=env)


def wait_for(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def gone(pid: int) -> bool:
    """Ended: no such process, or a zombie waiting for a parent that is not this test."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def test_the_trainers_messages_become_stage_loss_and_psnr():
    assert progress_event("stage 3: loss 0.0123, held-out PSNR 28.40 dB", 0.8) == {
        "event": "progress", "stage": "joint", "message": "stage 3: loss 0.0123, held-out PSNR 28.40 dB",
        "fraction": 0.8, "loss": 0.0123, "heldout_psnr": 28.4}
    event = progress_event("geometry: step 30/150 loss 0.0421", 0.05)
    assert (event["stage"], event["loss"], event["heldout_psnr"]) == ("geometry", 0.0421, None)
    event = progress_event("rendering reference views", 1.7)
    assert (event["stage"], event["fraction"], event["loss"]) == ("rendering reference views", 1.0, None)


def test_a_worker_is_started_and_its_progress_read_line_by_line(tmp_path):
    worker = python_worker("""
        import sys
        from NeuralRaycastLib.app.worker import JsonLines
        stream = JsonLines()
        print("a library's own chatter on standard output", flush=True)
        stream("geometry: step 30/150 loss 0.0421", 0.05)
        stream("stage 2: loss 0.0200, held-out PSNR 25.10 dB", 0.6)
        print("the compiler warns on standard error", file=sys.stderr)
        stream.write({"event": "done", "run_folder": sys.argv[1], "cancelled": False, "seconds": 1.5,
                      "heldout_psnr": 25.1})
    """, str(tmp_path / "run"))
    worker.start()
    assert worker.running and worker.pid
    seen = []
    outcome = worker.wait(seen.append)
    assert [(item.stage, item.loss, item.heldout_psnr) for item in seen] == [
        ("geometry", 0.0421, None), ("appearance", 0.02, 25.1)]
    assert outcome == Outcome("done", f"trained into {tmp_path / 'run'}", str(tmp_path / "run"), 0, 25.1)
    assert outcome.trained and not worker.running


def test_poll_never_blocks_and_hands_over_each_report_once():
    worker = python_worker("""
        import sys, time
        from NeuralRaycastLib.app.worker import JsonLines
        JsonLines()("stage 2: loss 0.5", 0.5)
        sys.stdin.readline()
    """)
    worker.start()
    start = time.monotonic()
    progress, outcome = worker.poll()
    assert time.monotonic() - start < 0.5 and outcome is None
    reports = list(progress)
    wait_for(lambda: reports.extend(worker.poll()[0]) or reports)
    assert [item.loss for item in reports] == [0.5]
    assert worker.poll() == ([], None)
    worker.kill()


def test_a_stop_request_lets_the_worker_save_the_state_reached(tmp_path):
    worker = python_worker("""
        import sys, time
        from NeuralRaycastLib.app.worker import JsonLines, StopOnStdin
        stop, stream = StopOnStdin(), JsonLines()
        stream("stage 2: loss 0.3", 0.1)
        while not stop():
            time.sleep(0.01)
        stream.write({"event": "done", "run_folder": sys.argv[1], "cancelled": True, "seconds": 0.5,
                      "heldout_psnr": None})
        sys.exit(130)
    """, str(tmp_path / "run"))
    worker.start()
    wait_for(lambda: worker.poll()[0])
    worker.request_stop()
    outcome = worker.wait()
    assert outcome.state == "cancelled" and outcome.run_folder == str(tmp_path / "run")
    assert outcome.message == f"cancelled; the state reached is saved in {tmp_path / 'run'}"


@posix_only
def test_cancel_ends_the_whole_process_tree(tmp_path):
    """The warm-up's compilers are the worker's children: ending the worker ends them too."""
    pids = tmp_path / "pids"
    worker = python_worker("""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(sys.argv[1], "w").write(f"{os.getpid()} {child.pid}")
        time.sleep(600)
    """, str(pids))
    worker.start()
    wait_for(lambda: pids.exists() and len(pids.read_text().split()) == 2)
    parent, child = map(int, pids.read_text().split())
    worker.kill()
    outcome = worker.poll()[1]
    assert outcome.state == "cancelled" and not outcome.trained
    assert outcome.message == "the training process was stopped; nothing was saved"
    wait_for(lambda: gone(parent) and gone(child), 10)


@posix_only
def test_a_worker_killed_from_outside_is_one_clear_message():
    """A GPU fault, a driver reset or the out-of-memory killer ends the worker without a word from it."""
    worker = python_worker("""
        import sys, time
        print("loading the study", file=sys.stderr, flush=True)
        time.sleep(600)
    """)
    worker.start()
    wait_for(lambda: worker._stderr)
    os.killpg(worker.pid, signal.SIGKILL)
    outcome = worker.wait()
    assert outcome.state == "crashed" and not outcome.trained
    assert outcome.message == ("the training process ended unexpectedly (signal SIGKILL); nothing was saved and the "
                               "scene is unchanged; its last words: loading the study")


def test_the_fit_command_reports_a_refused_run_as_one_error_line(tmp_path):
    """The real entry point the module starts: a run folder of other files is refused before any work, and the
    stream says so in the command line's own words."""
    from NeuralRaycastLib.study.study import Study, write_study

    study = Study.from_arrays({"t1": np.arange(120, dtype=np.float32).reshape(4, 5, 6)}, np.eye(4), name="tiny")
    manifest = write_study(study, tmp_path / "study")
    out = tmp_path / "documents"
    out.mkdir()
    (out / "notes.txt").write_text("the user's notes")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    worker = WorkerProcess([sys.executable, "-m", "NeuralRaycastLib.app.entry", "fit", str(manifest), "--out",
                            str(out), "--progress-json"], env=env)
    worker.start()
    outcome = worker.wait()
    assert outcome.state == "failed" and outcome.returncode == 2
    assert str(out) in outcome.message and "not empty" in outcome.message
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_the_fit_command_offers_the_progress_stream():
    help_text = subprocess.run([sys.executable, "-m", "NeuralRaycastLib.app.entry", "fit", "--help"],
                               capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                               check=True).stdout
    assert "--progress-json" in help_text


def test_a_worker_whose_starter_is_gone_stops_keeping_its_state():
    """Standard input closing (Slicer ended or crashed) asks the worker to stop, as a 'stop' line does."""
    import io

    from NeuralRaycastLib.app.worker import StopOnStdin

    gone_starter = StopOnStdin(io.StringIO(""))
    wait_for(gone_starter)
    asked = StopOnStdin(io.StringIO("status\nstop\n"))
    wait_for(asked)
    read, write = os.pipe()
    waiting = StopOnStdin(os.fdopen(read))  # open, silent: training goes on
    time.sleep(0.2)
    assert not waiting()
    os.close(write)
    wait_for(waiting)


def standby_worker(*options: str) -> WorkerProcess:
    """``neuralraycast standby`` as the Slicer module starts it, with a plain ``python`` for PythonSlicer."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return WorkerProcess([sys.executable, "-m", "NeuralRaycastLib.app.entry", "standby", "--preset", "quick",
                          *options], env=env, name="the training process kept ready")


@pytest.mark.gpu
def test_a_standby_worker_is_ready_before_its_study_and_then_runs_one_fit_job(phantom_study_dir, tmp_path):
    """Made ready ahead (the device open, the pretrained route's kernels called once on a phantom of its own), it
    then trains the study its job names, streaming that job's progress as a ``fit`` worker does, and ends."""
    leftovers = set(Path(tempfile.gettempdir()).glob("neuralraycast-standby-*"))
    worker = standby_worker("--warm", "yes")
    worker.start()
    try:
        wait_for(worker.poll_ready, 600)
        assert worker.warmed.startswith("the pretrained route and the network's stages on the phantom")
        assert not (tmp_path / "run").exists()
        worker.send_job([str(phantom_study_dir), "--out", str(tmp_path / "run"), "--preset", "quick",
                         "--appearance", "pretrained", "--iterations", "20", "--views", "4", "--size", "32"])
        seen = []
        outcome = worker.wait(seen.append)
    finally:
        worker.kill()
    assert outcome.state == "done" and outcome.run_folder == str(tmp_path / "run"), outcome
    assert outcome.heldout_psnr is not None and seen and seen[-1].fraction == 1.0
    assert {"model.safetensors", "appearance.safetensors", "run.json"} <= {p.name for p in (tmp_path / "run").iterdir()}
    # Its warm-up left nothing behind: its phantom's run went to a temporary folder, removed.
    assert set(Path(tempfile.gettempdir()).glob("neuralraycast-standby-*")) == leftovers
    with pytest.raises(RuntimeError, match="not ready"):  # one job a process
        worker.send_job([str(phantom_study_dir), "--out", str(tmp_path / "again")])


def test_a_standby_worker_without_a_job_ends_quietly_and_a_bad_job_is_one_error(tmp_path):
    """Standard input closed before a job (the module closed, Slicer ended): it ends, exit 0, nothing written.
    A job line that is not one ``fit`` job: one error line in the stream, exit 2."""
    idle = standby_worker("--warm", "no")
    idle.start()
    wait_for(idle.poll_ready, 120)
    assert idle.warmed == "nothing: asked not to"
    idle.process.stdin.close()
    assert idle.process.wait(timeout=60) == 0
    bad = standby_worker("--warm", "no")
    bad.start()
    wait_for(bad.poll_ready, 120)
    bad.process.stdin.write('{"render": ["study"]}\n')
    bad.process.stdin.flush()
    outcome = bad.wait()
    assert outcome.state == "failed" and outcome.returncode == 2 and '"fit"' in outcome.message, outcome
