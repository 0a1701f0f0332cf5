"""Where a Gaussian training step's time goes, and what a schedule buys in a fixed time: for each batch size
(patches a step), the device time of each kernel over a few steps of the preset's schedule (bench/kernel_clock)
and the host's wall time a step, then a fit with a time budget of ``--seconds`` (GaussianTrainConfig.seconds: the
learning rates and densification follow the time), its held-out PSNR and its pictures' time.

    python3 tools/gpu/gaussian_steps.py STUDY [--patches 32 128] [--seconds 30 | --steps 40] [--profile-steps 8]
        [--set initial=200000 --set densify_every=25 ...] [--untextured] [--dice] [--training-views 4]

STUDY is a study folder (``neuralraycast sample`` writes one). ``--set`` changes a field of the preset's
GaussianTrainConfig for every fit. Prints one block per batch size.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study")
    parser.add_argument("--patches", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--steps", type=int, default=0,
                        help="fit this many steps instead of for --seconds (the same fit on any device, e.g. a CPU's)")
    parser.add_argument("--training-views", type=int, default=0, metavar="K",
                        help="also score the first K training views before and after the fit (is a fall overfitting?)")
    parser.add_argument("--profile-steps", type=int, default=8)
    parser.add_argument("--preset", default=None)
    parser.add_argument("--frames", type=int, default=20, help="pictures timed after each fit")
    parser.add_argument("--save-pictures", default=None, metavar="NPZ",
                        help="save each fit's held-out pictures and their references (float16) to NPZ")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a GaussianTrainConfig field for every fit (repeatable)")
    parser.add_argument("--frame-sizes", type=int, nargs="*", default=[1024, 512])
    parser.add_argument("--untextured", action="store_true",
                        help="every structure's look without its channel's texture (modulation 0), for the views and "
                             "the Gaussians' starting colours: what the pictures' texture costs the fit")
    parser.add_argument("--dice", action="store_true",
                        help="after each fit, its structure weights' steps and each structure's Dice (as evaluate)")
    args = parser.parse_args()
    if args.untextured:
        from NeuralRaycastLib.render import style

        style._DEFAULTS = {name: (opacity, channels, window, 0.0, specular)
                           for name, (opacity, channels, window, _modulation, specular) in style._DEFAULTS.items()}

    import numpy as np

    from NeuralRaycastLib.bench.kernel_clock import kernel_clock
    from NeuralRaycastLib.gaussians.run import gaussian_schedule
    from NeuralRaycastLib.gaussians.train import (
        GaussianAdam,
        GaussianStep,
        initial_gaussians,
        render_picture,
        scene_for_study,
        score_views,
        train_gaussians,
        voxel_mm,
    )
    from NeuralRaycastLib.gpu.device import open_device
    from NeuralRaycastLib.render.patches import PatchSampler
    from NeuralRaycastLib.train.presets import RunSettings
    from NeuralRaycastLib.train.run_folder import prepare_for_run, reference_views_for_run

    gpu = open_device()
    settings = RunSettings.for_device(gpu, args.preset)
    prepared = prepare_for_run(args.study, settings)
    views = reference_views_for_run(gpu, prepared, settings)
    base = gaussian_schedule(settings)
    for item in args.set:
        name, value = item.split("=", 1)
        kind = type(getattr(base, name))
        parsed = value in ("1", "true", "True") if kind is bool else kind(float(value) if "." in value or "e" in value
                                                                           else int(value))
        base = replace(base, **{name: parsed})
    print(f"{gpu.backend}; preset {settings.preset}; views {len(views.training)} training of {settings.size}²")
    for patches in args.patches:
        config = replace(base, patches=patches)
        voxel = voxel_mm(prepared)
        scene = scene_for_study(gpu, prepared, initial_gaussians(prepared, config, config.initial), config)
        start = score_views(scene, views, views.held_out)
        trained_on = views.training[: args.training_views]
        seen = f", training views {score_views(scene, views, trained_on)['heldout_psnr']:.2f} dB" if trained_on else ""
        print(f"patches {patches}: {scene.count:,} Gaussians at the start, held-out {start['heldout_psnr']:.2f} dB"
              f"{seen} before any step")
        adam = GaussianAdam(gpu, scene, config, voxel)
        sampler = PatchSampler(views.targets(), views.training, size=config.patch_size, seed=config.seed)
        step = GaussianStep(gpu, scene, views, config)

        def one_step(sampler=sampler, config=config, step=step, adam=adam, scene=scene) -> float:
            rows = sampler.sample(config.patches)
            loss = step.loss_and_gradients(rows, sampler.reference_patches(rows))
            step.accumulate_statistics()
            adam.step(1.0)
            scene.build_grid()
            return loss

        if args.profile_steps:
            for _ in range(3):
                one_step()
            gpu.device.wait()
            started = time.perf_counter()
            for _ in range(args.profile_steps):
                one_step()
            gpu.device.wait()
            wall = (time.perf_counter() - started) / args.profile_steps
            with kernel_clock(gpu) as times:
                for _ in range(args.profile_steps):
                    one_step()
            per = times.per(args.profile_steps)
            print(f"patches {patches} ({patches * config.patch_size ** 2:,} rays), {scene.count:,} Gaussians: "
                  f"{wall * 1e3:.1f} ms a step (wall); kernels {per.total_ms:.1f} ms: {per.summary()}")
        del scene, adam, step
        fit_config = replace(config, steps=args.steps, seconds=None, eval_every=0) if args.steps else \
            replace(config, steps=1_000_000, seconds=args.seconds, eval_every=0)
        fitted, log = train_gaussians(gpu, prepared, views, fit_config)
        score = score_views(fitted, views, views.held_out)
        if trained_on:
            print(f"  training views after the fit: {score_views(fitted, views, trained_on)['heldout_psnr']:.2f} dB")
        named = ', '.join(args.set + ['untextured'] * args.untextured)
        print(f"  fit ({named or 'the preset'}, {patches} patches): {log.steps} steps in "
              f"{log.seconds:.1f} s, {fitted.count:,} Gaussians (counts {log.counts[-4:]}), "
              f"held-out {score['heldout_psnr']:.2f} dB, SSIM {score.get('heldout_ssim', float('nan')):.4f}, "
              f"last loss {np.mean([loss for _, loss in log.losses[-20:]]):.4f}")
        if args.dice:
            from NeuralRaycastLib.gaussians.geometry import gaussian_geometry_metrics, occupancy_distances
            from NeuralRaycastLib.gaussians.run import fit_structure_weights

            structures, _ = fit_structure_weights(fitted, prepared, fit_config, log)
            geometry = gaussian_geometry_metrics(occupancy_distances(fitted, structures, prepared), prepared)
            print("  Dice " + ", ".join(f"{name} {figures['dice']:.4f}" for name, figures in geometry.items()))
        if args.save_pictures:
            pictures = {f"picture_{patches}_{index}": render_picture(fitted, views.cameras[index]).astype(np.float16)
                        for index in views.held_out}
            pictures.update({f"reference_{index}": views.images[index].rgb().astype(np.float16)
                             for index in views.held_out})
            np.savez_compressed(args.save_pictures, **pictures)
        for size in args.frame_sizes:
            camera = replace(views.cameras[views.held_out[0]], width=size, height=size)
            fitted.render_picture(camera)
            frames = []
            for _ in range(args.frames):
                began = time.perf_counter()
                fitted.render_picture(camera)
                frames.append(time.perf_counter() - began)
            print(f"  {size}² picture (a held-out view's camera, packed and read back): median "
                  f"{np.median(frames) * 1e3:.2f} ms, fastest {min(frames) * 1e3:.2f} ms of {args.frames}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
