"""Frame by frame, what a run's live view costs: the frames `frame-rate` renders (a camera orbiting the study, a
full turn over the frames), each timed apart, with the bands it was drawn in, whether it was drawn again for want
of room for its shaded segments, the device buffers it made and the GPU memory in use after it.

    python3 tools/gpu/frame_trace.py RUN_FOLDER [--size 1024] [--frames 30] [--gpu-memory 6G]

Prints one line a frame and a summary (mean, median, slowest; frames that made buffers or were drawn again).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_folder")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--frames", type=int, default=30)
    parser.add_argument("--gpu-memory", default=None)
    args = parser.parse_args()

    from NeuralRaycastLib.gpu.device import device_memory_in_use, open_device
    from NeuralRaycastLib.render import neural_render, sample_buffers
    from NeuralRaycastLib.render.camera import framing_distance
    from NeuralRaycastLib.render.live_view import live_camera
    from NeuralRaycastLib.train.run_folder import open_run

    gpu = open_device(None, args.gpu_memory)
    run = open_run(gpu, args.run_folder)
    renderer = run.renderer
    made: list[str] = []
    for module in (neural_render, sample_buffers):
        original = module.device_memory

        def recorded(what: str, original=original):
            made.append(what)
            return original(what)

        module.device_memory = recorded
    passes: list[bool] = []
    render_frame = renderer._render_frame

    def counted_frame(*call, **options):
        passes.append(bool(options.get("counted")))
        return render_frame(*call, **options)

    renderer._render_frame = counted_frame
    low, high = run.prepared.bounds
    centre = (low + high) / 2
    distance = framing_distance(float((high - low).max() / 2), 30.0, args.size, args.size)
    seconds, allocating, again = [], [], []
    print(f"{type(renderer.scene).__name__}, {args.size}² frames, budget {gpu.memory.describe()}")
    for index in range(args.frames + 1):
        angle = 2.0 * math.pi * max(index - 1, 0) / args.frames
        position = centre + distance * np.array([math.cos(angle), math.sin(angle), 0.25])
        camera = live_camera(position, centre, (0.0, 0.0, 1.0), 30.0, (args.size, args.size))
        made.clear()
        passes.clear()
        start = time.perf_counter()
        renderer.render_picture(camera)
        elapsed = time.perf_counter() - start
        in_use = device_memory_in_use(gpu)
        bands = [rays for rays, _slots, _need in renderer.band_work]
        if index:
            seconds.append(elapsed)
            allocating += [index] if made else []
            again += [index] if len(passes) > 1 else []
        print(f"frame {index:2d}{' (first, apart)' if not index else ''}: {1e3 * elapsed:7.2f} ms; "
              f"{len(bands)} bands of {max(bands):,} rays at most; passes {len(passes)}"
              f"{' (drawn again, counted)' if len(passes) > 1 else ''}; buffers made {len(made)}"
              f"{': ' + '; '.join(made) if made else ''}; "
              f"GPU memory in use {in_use / 2**30 if in_use else float('nan'):.2f} GiB")
    times = np.asarray(seconds) * 1e3
    print(f"summary: {len(times)} frames, mean {times.mean():.2f} ms, median {statistics.median(times):.2f} ms, "
          f"fastest {times.min():.2f} ms, slowest {times.max():.2f} ms (frame {int(times.argmax()) + 1}); frames that "
          f"made buffers: {allocating or 'none'}; drawn again: {again or 'none'}")
    from NeuralRaycastLib.bench.kernel_clock import kernel_clock

    try:
        with kernel_clock(gpu) as kernels:
            renderer.render_picture(camera)
        print(f"kernels of the last view again (device timestamps): {kernels.total_ms:.2f} ms; {kernels.summary()}; "
              f"from the first kernel's start to the last one's end {kernels.span_ms:.2f} ms")
        from NeuralRaycastLib.bench.suites import work_per_ray

        print("work of the last view: {:.1f} samples, {:.2f} shaded segments a ray".format(
            *work_per_ray(renderer, camera)))
    except Exception as error:  # (a device without timestamps: the frames above stand)
        print(f"kernels not timed: {error}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
