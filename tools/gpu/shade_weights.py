"""What the finished field's shading weight trades: a run's pictures with every composited segment shaded (weight
0) against larger weights, at 512² and 1024² from three sides: PSNR and largest pixel difference against exact
shading, PSNR against the volumetric reference renderer (no shadows), shaded segments per ray, frame time.

    python3 tools/gpu/shade_weights.py RUN_FOLDER
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

WEIGHTS = (0.0, 4e-3, 5e-3, 6e-3, 7e-3, 8e-3, 1e-2)


def main(folder: str) -> int:
    from NeuralRaycastLib.gpu.device import open_device
    from NeuralRaycastLib.render.camera import orbit_cameras
    from NeuralRaycastLib.render.metrics import psnr
    from NeuralRaycastLib.render.reference_render import ReferenceRenderer
    from NeuralRaycastLib.train.run_folder import open_run

    gpu = open_device(None, None)
    run = open_run(gpu, folder)
    renderer = run.renderer
    print("picture shade weight of the run:", renderer.shade_weight, "min weight", renderer.min_weight)
    reference = ReferenceRenderer(gpu, run.prepared)
    for size in (512, 1024):
        cameras = orbit_cameras(run.prepared.bounds, 3, size, size)
        renderer.shade_weight = 0.0
        exact = [renderer.render(camera).rgba.copy() for camera in cameras]
        volumetric = [reference.render(camera, shadows=False).rgba.copy() for camera in cameras]
        for weight in WEIGHTS:
            renderer.shade_weight = weight
            pictures = [renderer.render(camera).rgba.copy() for camera in cameras]
            largest = max(float(np.abs(p - e).max()) for p, e in zip(pictures, exact, strict=True))
            against_exact = [psnr(p[..., :3], e[..., :3]) for p, e in zip(pictures, exact, strict=True)]
            against_reference = [psnr(p[..., :3], v[..., :3]) for p, v in zip(pictures, volumetric, strict=True)]
            for _ in range(3):
                renderer.render(cameras[1])
            times = []
            for _ in range(20):
                start = time.perf_counter()
                renderer.render(cameras[1])
                times.append(1e3 * (time.perf_counter() - start))
            shaded = renderer._batch.lists.shaded / (size * size)
            print(f"{size}² weight {weight:g}: PSNR vs exact {min(against_exact):.1f}-{max(against_exact):.1f} dB, "
                  f"largest difference {largest * 255:.2f}/255, vs reference {np.mean(against_reference):.2f} dB, "
                  f"shaded {shaded:.2f} a ray, frame median {statistics.median(times):.2f} "
                  f"min {min(times):.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
