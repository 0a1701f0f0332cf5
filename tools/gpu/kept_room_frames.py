"""A run's 512² and 1024² frames drawn on the room kept for their view (no count read inside the frame) against
the same frames with each band's count read first, alternating twice, 30 frames each (`render()` and
`render_picture()`).

    python3 tools/gpu/kept_room_frames.py RUN_FOLDER [DEVICE]

DEVICE: cuda, vulkan or metal (default: the best the machine has).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np


def main(folder: str, device: str | None = None) -> int:
    from NeuralRaycastLib.gpu.device import open_device
    from NeuralRaycastLib.render.camera import orbit_cameras
    from NeuralRaycastLib.render.neural_render import DiffRenderer
    from NeuralRaycastLib.train.run_folder import open_run

    gpu = open_device(device, None)
    run = open_run(gpu, folder)
    renderer = run.renderer
    kept = DiffRenderer._room_kept
    for size in (512, 1024):
        camera = orbit_cameras(run.prepared.bounds, 3, size, size)[1]
        for label in ("kept room", "count read", "kept room", "count read"):
            DiffRenderer._room_kept = kept if label == "kept room" else (lambda self, batch, rays: False)
            for _ in range(3):
                renderer.render(camera)
            times = []
            for _ in range(30):
                start = time.perf_counter()
                renderer.render(camera)
                times.append(1e3 * (time.perf_counter() - start))
            renderer.render_picture(camera)
            start = time.perf_counter()
            for _ in range(30):
                renderer.render_picture(camera)
            picture_ms = 1e3 * (time.perf_counter() - start) / 30
            print(f"{size}² {label}: render() mean {np.mean(times):.2f} median {statistics.median(times):.2f} "
                  f"min {min(times):.2f} ms; render_picture() mean {picture_ms:.2f} ms; bands {renderer.band_work}")
    DiffRenderer._room_kept = kept
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
