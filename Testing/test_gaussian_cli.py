"""The Gaussian branch on the command line: ``fit --representation gaussians`` on the phantom with the quick
preset, then ``evaluate`` and ``render`` on its run folder, and the refusals (a damaged model file, commands the
branch does not offer yet) as one line and exit status 2."""

from __future__ import annotations

import json

import pytest

from NeuralRaycastLib.app.cli import main

pytestmark = pytest.mark.gpu

#: What the quick preset's Gaussians reach on the phantom's held-out view in this test's 60 steps on lavapipe
#: (20.6 dB; 15 dB before training), less a margin for another device's rounding.
HELD_OUT_PSNR_DB = 19.5


@pytest.fixture(scope="module")
def gaussian_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gaussians")
    assert main(["sample", str(folder / "s"), "--case", "phantom", "--spacing", "4"]) == 0
    manifest = next((folder / "s").rglob("manifest.json"))
    run = folder / "run"
    code = main(["fit", str(manifest), "--representation", "gaussians", "--preset", "quick", "--iterations", "60",
                 "--views", "8", "--size", "64", "--out", str(run)])
    return code, run


def test_fit_writes_a_gaussian_run_folder(gaussian_run, capsys):
    code, run = gaussian_run
    assert code == 0
    assert {"run.json", "gaussians.safetensors", "train_log.json", "reference"} == {p.name for p in run.iterdir()}
    assert json.loads((run / "run.json").read_text())["representation"] == "gaussians"
    log = json.loads((run / "train_log.json").read_text())
    assert log["steps"] == 60 and not log["cancelled"] and log["gaussians"] > 0
    assert (run / "reference" / "cameras.json").is_file()


def test_evaluate_scores_the_held_out_view(gaussian_run, capsys):
    _, run = gaussian_run
    capsys.readouterr()
    assert main(["evaluate", str(run), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["representation"] == "gaussians"
    assert metrics["heldout_psnr"] >= HELD_OUT_PSNR_DB, metrics["heldout_psnr"]
    assert 0 < metrics["heldout_ssim"] <= 1
    assert metrics["model_bytes"] == (run / "gaussians.safetensors").stat().st_size
    assert json.loads((run / "metrics.json").read_text())["heldout_psnr"] == metrics["heldout_psnr"]
    # the score the training logged for its last step is the one evaluate finds again
    assert json.loads((run / "train_log.json").read_text())["heldout_psnr"] == pytest.approx(metrics["heldout_psnr"],
                                                                                             abs=1e-3)


def test_render_writes_the_views(gaussian_run, tmp_path, capsys):
    _, run = gaussian_run
    out = tmp_path / "views"
    assert main(["render", str(run), "--views", "2", "--size", "32", "24", "--out", str(out)]) == 0
    assert (out / "contact_sheet.png").is_file() and (out / "cameras.json").is_file()


def test_damaged_model_and_field_only_commands_are_refused_in_one_line(gaussian_run, tmp_path, capsys):
    _, run = gaussian_run
    capsys.readouterr()
    assert main(["mesh", str(run), "--out", str(tmp_path / "m")]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and str(run) in error and "Gaussian run" in error
    assert not (tmp_path / "m").exists()

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for entry in ("run.json", "train_log.json"):
        (damaged / entry).write_bytes((run / entry).read_bytes())
    data = bytearray((run / "gaussians.safetensors").read_bytes())
    data[-5] ^= 0xFF  # a flipped bit in the last Gaussian's colour
    (damaged / "gaussians.safetensors").write_bytes(bytes(data))
    assert main(["evaluate", str(damaged)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert str(damaged / "gaussians.safetensors") in error and "checksum" in error
    assert not (damaged / "metrics.json").exists()
