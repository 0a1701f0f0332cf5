"""What a Gaussian picture's time depends on: a trained Gaussian run's 1024² packed picture (the live view's)
timed under variants of the grid's cell size (which changes the work, never the picture: each variant's bytes are
compared with the run's own), of the march's segment length and stopping transmittance (which change the picture:
each variant's held-out PSNR is given), and of the shader's compile-time constants (``--define``).

    python3 tools/gpu/gaussian_frames.py RUN [--cells 2 3 4] [--steps 0.7 1.0] [--stops 1e-3 1e-2]
        [--define GAUSSIAN_CHUNK=4 ...] [--untextured] [--gbuffer] [--frames 20] [--size 1024]

RUN is a run folder of ``neuralraycast fit --representation gaussians``. Cell sizes and segment lengths are in
voxels of the prepared study. Prints one line per variant: the wall time of a picture (median and fastest), the
device time of its kernel, the grid's list entries and, where the picture changes, its held-out PSNR.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--cells", type=float, nargs="*", default=[], help="grid cell sizes to try, in voxels")
    parser.add_argument("--base-cells", type=float, default=0.0,
                        help="cells of this size (voxels) in place of the run's for every other variant")
    parser.add_argument("--steps", type=float, nargs="*", default=[], help="segment lengths to try, in voxels")
    parser.add_argument("--stops", type=float, nargs="*", default=[], help="stopping transmittances to try")
    parser.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                        help="compile the Gaussians' shader with this constant too (one variant per --define)")
    parser.add_argument("--untextured", action="store_true", help="also time the picture without its texture")
    parser.add_argument("--train-patches", type=int, default=0, metavar="P",
                        help="also time a training step of P patches (its forward and backward kernels) with the "
                             "run's own settings and each --define")
    parser.add_argument("--gbuffer", action="store_true",
                        help="also time the G-buffer (colour, depth and normals read back, as the bench's frames)")
    parser.add_argument("--frames", type=int, default=20)
    parser.add_argument("--size", type=int, default=1024)
    args = parser.parse_args()

    import numpy as np
    import slangpy as spy

    from NeuralRaycastLib.bench.kernel_clock import kernel_clock
    from NeuralRaycastLib.bench.report import timed_each
    from NeuralRaycastLib.gaussians.run import gaussian_schedule, open_gaussian_run
    from NeuralRaycastLib.gaussians.scene import GaussianScene, GridShape, MarchSettings
    from NeuralRaycastLib.gaussians.train import GaussianStep, score_views, voxel_mm
    from NeuralRaycastLib.gpu.device import open_device
    from NeuralRaycastLib.render.patches import PatchSampler
    from NeuralRaycastLib.train.run_folder import reference_views_for_run

    gpu = open_device()
    run = open_gaussian_run(gpu, args.run)
    views = reference_views_for_run(gpu, run.prepared, run.settings)
    base = run.scene
    voxel = voxel_mm(run.prepared)
    camera = replace(views.cameras[views.held_out[0]], width=args.size, height=args.size)
    bounds = np.array([base.grid.low, base.grid.high])

    def scene_with(grid: GridShape | None = None, march: MarchSettings | None = None) -> GaussianScene:
        """The base scene's Gaussians on another grid or with another march."""
        return GaussianScene(gpu, base.gaussians(), grid or base.grid, base.density_scale, march or base.march,
                             base.geometry_thickness, base.channels, base.highlights)

    if args.base_cells:
        base = scene_with(grid=GridShape.for_box(bounds, args.base_cells * voxel))
    print(f"{gpu.backend}; {base.count:,} Gaussians; voxel {voxel:.3f} mm; grid {base.grid.dims} cells of "
          f"{np.round(base.grid.cell_size, 3).tolist()} mm; march {base.march}")

    def time_render(render, kernel_name: str) -> str:
        render(camera)
        frames = timed_each(lambda: render(camera), float("inf"), args.frames)
        with kernel_clock(gpu) as times:
            for _ in range(args.frames):
                render(camera)
        kernel = times.per(args.frames).milliseconds.get(kernel_name, float("nan"))
        return f"median {np.median(frames) * 1e3:.2f} ms, fastest {min(frames) * 1e3:.2f} ms, kernel {kernel:.2f} ms"

    def time_pictures(scene: GaussianScene) -> tuple[np.ndarray, str]:
        picture = scene.render_picture(camera).copy()
        line = time_render(scene.render_picture, "renderCameraPacked")
        if args.gbuffer:
            line += f"; G-buffer {time_render(scene.render_image, 'renderCameraPlanes')}"
        starts = np.asarray(scene._cell_start.to_numpy())
        entries, filled = int(starts[-1]), np.count_nonzero(np.diff(starts))
        return picture, f"{line}; {entries:,} list entries in {filled:,} cells ({entries / max(filled, 1):.1f} each)"

    def time_steps(scene: GaussianScene, repeats: int = 5) -> str:
        if not args.train_patches:
            return ""
        config = replace(gaussian_schedule(run.settings), patches=args.train_patches)
        sampler = PatchSampler(views.targets(), views.training, size=config.patch_size, seed=0)
        step = GaussianStep(gpu, scene, views, config)
        batches = [sampler.sample(config.patches) for _ in range(repeats)]
        for rows in batches[:2]:
            step.loss_and_gradients(rows, sampler.reference_patches(rows))
        with kernel_clock(gpu) as times:
            for rows in batches:
                step.loss_and_gradients(rows, sampler.reference_patches(rows))
        ms = times.per(repeats).milliseconds
        return (f"; a step of {args.train_patches} patches: forward {ms.get('renderRays', float('nan')):.2f} ms, "
                f"backward {ms.get('renderRaysBackward', float('nan')):.2f} ms")

    reference, line = time_pictures(base)
    print(f"the run's own: {line}{time_steps(base)}")
    for cells in args.cells:
        scene = scene_with(grid=GridShape.for_box(bounds, cells * voxel))
        picture, line = time_pictures(scene)
        same = int(np.abs(picture.astype(int) - reference.astype(int)).max())
        print(f"cells of {cells} voxels ({np.round(scene.grid.cell_size, 3).tolist()} mm): {line}; "
              f"largest byte difference from the run's picture {same}")
    marches = [replace(base.march, step_mm=s * voxel) for s in args.steps] + \
              [replace(base.march, min_transmittance=t) for t in args.stops]
    for march in marches:
        scene = scene_with(march=march)
        _, line = time_pictures(scene)
        score = score_views(scene, views, views.held_out)
        print(f"{march}: {line}; held-out {score['heldout_psnr']:.2f} dB")
    if args.untextured:
        scene = scene_with()
        scene._look_struct = dict(scene._look_struct, textured=0)
        _, line = time_pictures(scene)
        print(f"untextured (the picture changes): {line}")
    for item in args.define:
        name, value = item.split("=", 1)
        scene = scene_with()
        scene.module = spy.Module.load_from_module(gpu.device, gpu.session(None, {name: value}).load_module(
            "gaussians.slang"))
        began = time.perf_counter()
        picture = scene.render_picture(camera)
        compiled = time.perf_counter() - began
        picture, line = time_pictures(scene)
        same = int(np.abs(picture.astype(int) - reference.astype(int)).max())
        print(f"{name}={value} (compiled in {compiled:.1f} s): {line}; largest byte difference {same}"
              f"{time_steps(scene)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
