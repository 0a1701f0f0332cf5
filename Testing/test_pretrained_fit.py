"""``fit --appearance pretrained`` on the phantom with the quick preset: the geometry fitted as today, the
pretrained encoder run over the study into its latent grid, and the run renderable with no appearance
training, as close to the held-out references as measured, and so again when the run is evaluated."""

from __future__ import annotations

import json

import numpy as np
import pytest

from NeuralRaycastLib.app.cli import main

pytestmark = pytest.mark.gpu

#: Measured on lavapipe: 45.2 dB with the shipped weights (45.0 with the earlier three-study ones), 44.7 dB with
#: weights pretrained on one phantom of a cohort seed for 300 steps, 24.8 dB with weights after one step (the
#: appearance is the pretrained one, not the field's untrained network); the per-study network's quick preset,
#: 45.4 dB.
MIN_PSNR = 40.0


def test_fit_names_a_missing_weights_file_and_refuses_pretrained_options_without_the_route(phantom_study_dir, tmp_path,
                                                                                   capsys):
    out = tmp_path / "run"
    missing = tmp_path / "none.safetensors"
    assert main(["fit", str(phantom_study_dir), "--out", str(out), "--appearance", "pretrained",
                 "--weights", str(missing)]) == 2
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and str(missing) in message and "neuralraycast pretrain" in message
    assert main(["fit", str(phantom_study_dir), "--out", str(out), "--fine-tune", "10"]) == 2
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and "--appearance pretrained" in message
    assert main(["fit", str(phantom_study_dir), "--out", str(out), "--appearance", "pretrained",
                 "--representation", "gaussians"]) == 2
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and "--representation" in message
    assert not out.exists()


def test_the_pretrained_appearance_renders_a_new_study_without_appearance_training(phantom_study_dir, tmp_path,
                                                                                     capsys, monkeypatch):
    """With the weights the package ships (pretrained on cohort seeds: the study's seed is not among them)."""
    from NeuralRaycastLib.render.reference_views import ReferenceViews

    out = tmp_path / "run"
    with monkeypatch.context() as patched:  # without a fine-tune no image step runs: the targets are not gathered
        patched.setattr(ReferenceViews, "targets", lambda views: pytest.fail("the image steps' targets gathered"))
        assert main(["fit", str(phantom_study_dir), "--out", str(out), "--preset", "quick", "--appearance",
                     "pretrained", "--no-warmup"]) == 0
    printed = capsys.readouterr().out
    # The time to a renderable model, phase by phase: the evaluation's reference views and a compile left out.
    line = next(line for line in printed.splitlines() if line.startswith("study to renderable model: "))
    summary, phases = line.split("): ", 1)
    assert all(f"{phase} " in phases for phase in ("boundary maps", "SDF fit", "encode", "save")), line
    assert "reference views" not in phases and "compile" not in phases and "no appearance training" in summary
    # The total is the phases' sum; by default nothing is made beside the boundary maps (train/field_ahead.py).
    parts = [part.split() for part in phases.split("; ")[0].split(" · ")]
    own = [float(part[part.index("s") - 1]) for part in parts if "beside" not in part]
    assert float(summary.split(": ")[1].split(" s")[0]) == pytest.approx(sum(own), abs=0.005 * len(own))
    assert len(own) == len(parts) and ["field"] in [part[:1] for part in parts], line
    log = json.loads((out / "train_log.json").read_text())
    assert log["rays"] == 0  # no appearance training: not one ray rendered for a training step
    psnr = [row["heldout_psnr"] for row in log["rows"] if "heldout_psnr" in row]
    assert len(psnr) == 1 and psnr[0] >= MIN_PSNR, psnr
    # The latent grid (fp16) is saved with the run, no larger than its model, and the run renders with it again.
    appearance = out / "appearance.safetensors"
    assert 0 < appearance.stat().st_size <= (out / "model.safetensors").stat().st_size
    assert main(["evaluate", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["heldout_psnr"] == pytest.approx(psnr[0], abs=0.05)
    assert metrics["appearance_bytes"] == appearance.stat().st_size
    # The web page renders the field's own appearance network only: refused, by the run's name, nothing written.
    page = tmp_path / "page.html"
    capsys.readouterr()
    assert main(["share", str(out), "--out", str(page)]) == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]  # after the study's preparation's progress
    assert message.startswith("neuralraycast share: error:") and str(out) in message and "pretrained" in message
    assert not page.exists()
    # Only the bricks near the surfaces are stored: fewer codes than the grid over the whole box has.
    from safetensors import safe_open

    with safe_open(str(appearance), framework="numpy") as handle:
        grid = json.loads(handle.metadata()["neuralraycast"])["grid"]
        stored = handle.get_slice("grid").get_shape()[0]
    assert 0 < stored < grid["dims"][0] * grid["dims"][1] * grid["dims"][2]
    # A damaged latent grid is refused in one line naming the file, never rendered half-loaded.
    data = bytearray(appearance.read_bytes())
    data[-3] ^= 0xFF
    appearance.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["evaluate", str(out)]) == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert str(appearance) in message and "digest" in message


def test_a_cancelled_pretrained_fit_keeps_its_geometry_with_the_pretrained_appearance(gpu, phantom_study_dir,
                                                                                        tmp_path):
    """Cancelled while the geometry fits: the state reached is saved with its latent grid (a run that renders with
    the pretrained appearance, not the field's untrained network), and no fine-tune follows."""
    import itertools

    from NeuralRaycastLib.appearance.latent_scene import LatentFieldScene, PretrainedAppearance
    from NeuralRaycastLib.appearance.pretrain import SHIPPED_WEIGHTS
    from NeuralRaycastLib.train.presets import RunSettings
    from NeuralRaycastLib.train.run import train_study

    calls = itertools.count()
    run = train_study(gpu, phantom_study_dir, tmp_path / "run", RunSettings.for_device(gpu, "quick", views=4, size=32),
                      should_stop=lambda: next(calls) >= 20, warm_up=False,
                      appearance=PretrainedAppearance.read(SHIPPED_WEIGHTS, fine_tune_steps=5))
    assert run.log.cancelled
    assert (tmp_path / "run" / "appearance.safetensors").is_file()
    assert isinstance(run.renderer.scene, LatentFieldScene)
    assert not [row for row in run.log.rows if row.get("stage") == 2]  # neither a fine-tune nor a score
    # Encoded from the local inputs the trainer's scene holds on the device (the phantom fills every channel slot):
    # the codes the study's own upload of the encoder's inputs gives.
    from NeuralRaycastLib.appearance.latent_scene import load_appearance, uploaded_inputs
    from NeuralRaycastLib.field.field_render import FieldScene

    assert uploaded_inputs(FieldScene(gpu, run.field, run.prepared), run.prepared) is not None
    saved = load_appearance(gpu, tmp_path / "run" / "appearance.safetensors", run.field).stored_codes()
    fresh = PretrainedAppearance.read(SHIPPED_WEIGHTS).encode_study(gpu, run.prepared, run.field).stored_codes()
    assert saved.size and np.array_equal(saved, fresh)


def test_on_tensor_cores_the_frames_decode_what_the_per_thread_decoder_does(gpu, phantom_study_dir, tmp_path,
                                                                             monkeypatch):
    """Where the geometry network runs on tensor cores the frames decode on them too, from a tiled copy of the
    decoder (half operands): the picture the per-thread decoder draws, to half precision; once the decoder's weights
    change (a fine-tune's step, or set anew) the next frame decodes with the new ones. CUDA only."""
    if gpu.backend != "cuda":
        pytest.skip("needs CUDA (tensor cores)")
    from NeuralRaycastLib.appearance.latent_scene import LatentFieldScene, PretrainedAppearance
    from NeuralRaycastLib.appearance.pretrain import SHIPPED_WEIGHTS
    from NeuralRaycastLib.render.camera import orbit_cameras
    from NeuralRaycastLib.render.metrics import psnr
    from NeuralRaycastLib.train.presets import RunSettings
    from NeuralRaycastLib.train.run import train_study

    run = train_study(gpu, phantom_study_dir, tmp_path / "run", RunSettings.for_device(gpu, "quick", views=4, size=32),
                      warm_up=False, appearance=PretrainedAppearance.read(SHIPPED_WEIGHTS))
    scene = run.renderer.scene
    assert isinstance(scene, LatentFieldScene) and scene.decodes_on_tensor_cores
    camera = orbit_cameras(run.prepared.bounds, 1, 96, 80)[0]

    def pictures() -> tuple[np.ndarray, np.ndarray]:
        tiled = run.renderer.render(camera).rgb()
        with monkeypatch.context() as patched:
            patched.setattr(LatentFieldScene, "decodes_on_tensor_cores", property(lambda self: False))
            per_thread = run.renderer.render(camera).rgb()
        return tiled, per_thread

    tiled, per_thread = pictures()
    assert per_thread.max() > 0.1 and psnr(tiled, per_thread) > 45.0
    weights = scene.latent.parameters()
    offset = scene.latent.config.decoder_offset
    weights[offset:] *= 0.5  # a darker, flatter decoder
    scene.latent.set_parameters(weights)
    changed, changed_per_thread = pictures()
    assert psnr(changed, changed_per_thread) > 45.0 and psnr(changed, tiled) < 35.0


def test_after_the_warm_up_a_pretrained_fit_with_a_fine_tune_compiles_nothing(gpu, phantom_study_dir, tmp_path):
    """``neuralraycast warmup``'s parts cover the pretrained route: after the SDF fit's part and the pretrained
    appearance's, a whole ``fit --appearance pretrained --fine-tune`` (encoder, fine-tune, held-out score, save)
    builds no Slang module and no kernel in this process (counted at slangpy's entry points)."""
    from test_study_kernels import counted_compiles

    from NeuralRaycastLib.appearance.latent_scene import PretrainedAppearance
    from NeuralRaycastLib.appearance.pretrain import SHIPPED_WEIGHTS
    from NeuralRaycastLib.train import warmup
    from NeuralRaycastLib.train.presets import RunSettings, training_schedule
    from NeuralRaycastLib.train.run import train_study
    from NeuralRaycastLib.train.run_folder import prepare_for_run

    settings = RunSettings.for_device(gpu, "quick", views=4, size=32)
    prepared = prepare_for_run(phantom_study_dir, settings)
    views = warmup.tiny_views(gpu, prepared)
    for part in ("fit", "pretrained"):
        warmup.warm_up_part(gpu, prepared, views, settings, part)
    appearance = PretrainedAppearance.read(SHIPPED_WEIGHTS, fine_tune_steps=2)
    with counted_compiles() as compiled:
        run = train_study(gpu, phantom_study_dir, tmp_path / "run", settings, warm_up=False, appearance=appearance,
                          config=training_schedule("quick", settings.seed).with_total_steps(3))
    assert (compiled["modules"], compiled["pipelines"]) == ([], []), compiled
    assert (run.folder / "appearance.safetensors").is_file() and run.log.last("heldout_psnr") is not None


def test_maps_that_fail_while_the_field_is_made_beside_them_give_one_error_and_write_nothing(
        phantom_study_dir, tmp_path, capsys, monkeypatch):
    """With NEURALRAYCAST_FIELD_BESIDE_MAPS=1 the field is made on a thread of its own as soon as the study's box is
    known, while the boundary maps are still computed: where the maps then fail, the fit says that failure in one
    line, writes no run folder, and leaves no thread of its own working on the device."""
    import threading

    from NeuralRaycastLib.study.study import StudyError
    from NeuralRaycastLib.train import field_ahead, run

    monkeypatch.setenv(field_ahead.BESIDE_MAPS_VARIABLE, "1")

    prepare, outlines = run.prepare_for_run, []

    def maps_that_fail(study, settings, progress, gpu=None, with_outline=None, before_maps=None):
        def field_started_then_maps_fail(outline) -> None:
            with_outline(outline)
            outlines.append(outline)
            raise StudyError("structure 'brain' (the brain mask): no voxels inside it")

        return prepare(study, settings, progress, gpu, with_outline=field_started_then_maps_fail,
                       before_maps=before_maps)

    monkeypatch.setattr(run, "prepare_for_run", maps_that_fail)
    out = tmp_path / "runs" / "run"
    assert main(["fit", str(phantom_study_dir), "--out", str(out), "--preset", "quick", "--appearance",
                 "pretrained", "--no-warmup"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(outlines) == 1
    assert err.replace("\r", "\n").strip().splitlines()[-1] == (
        "neuralraycast fit: error: structure 'brain' (the brain mask): no voxels inside it")
    assert not out.exists() and not [path for path in tmp_path.rglob("*") if path.is_file()]
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("field-ahead")]
