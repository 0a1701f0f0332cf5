"""A run's 1024² frame on one device with the G-buffer read back the two ways ReadBack knows: through a host
buffer kept between reads, and by the tensor's own ``to_numpy`` (a staging buffer made each read), alternating
twice, 20 frames each; the read alone, both ways; and the kept buffer's read in its parts (the device's copy into
it, the host's copy out of it).

    python3 tools/gpu/read_back_frames.py RUN_FOLDER [--device vulkan] [--size 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def timed(action, repeats: int) -> list[float]:
    action()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(1e3 * (time.perf_counter() - start))
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--device", default=None)
    parser.add_argument("--size", type=int, default=1024)
    args = parser.parse_args()

    from NeuralRaycastLib.gpu.device import open_device
    from NeuralRaycastLib.render.camera import orbit_cameras
    from NeuralRaycastLib.train.run_folder import open_run

    gpu = open_device(args.device, None)
    print(f"device: {gpu.report.adapter} ({gpu.backend})")
    run = open_run(gpu, args.run)
    renderer = run.renderer
    camera = orbit_cameras(run.prepared.bounds, 3, args.size, args.size)[1]
    reader = renderer._read_back
    for kept in (True, False, True, False):
        reader.kept = kept
        label = "kept host buffer" if kept else "tensor's to_numpy"
        frames = timed(lambda: renderer.render(camera), 20)
        planes = renderer._planes
        reads = timed(lambda planes=planes: reader.read(planes), 10)
        print(f"{args.size}² {label}: render() mean {np.mean(frames):.2f} median {statistics.median(frames):.2f} "
              f"min {min(frames):.2f} ms; the read alone median {statistics.median(reads):.2f} ms; "
              f"bands {len(renderer.band_work)}")
    # The kept host buffer's read in its two parts: the device's copy into it (waited for), then the host's copy
    # out of its mapped memory into a new array.
    reader.kept = True
    reader.read(planes)
    kept, size = reader._kept, reader._kept.size
    copy = timed(lambda: reader._copy_into(kept, planes, size), 10)
    host = timed(kept.to_numpy, 10)
    print(f"{size / 2**20:.3g} MiB through the kept host buffer: the device's copy median "
          f"{statistics.median(copy):.2f} ms, the host's copy median {statistics.median(host):.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
