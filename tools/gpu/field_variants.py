"""What the field's kernels cost on one device under variants, each timed after two seconds of the same work (the
first fit after a compile has measured as little as half the points/s of the same fit straight after it):

- the SDF fit's points/s and kernel times (``--fit``);
- the geometry network's distances at ``--points`` points inside the study's box (every lane of every wave busy),
  on the run's module and on the per-thread one;
- a trained run's G-buffer frame, wall and kernel times (``--per-thread``: also with the networks per thread where
  the device has cooperative vectors);
- every one of these again with the field's compiler session given extra constants (``--define``, one variant
  each).

(tools/gpu/read_back_frames.py times the G-buffer's read-back in its parts.)

    python3 tools/gpu/field_variants.py RUN [--fit] [--define NAME=VALUE ...] [--per-thread] [--size 1024]
        [--frames 10] [--fit-steps 150] [--points 8388608]

RUN is a run folder of ``neuralraycast fit``; the device is the default one (``NEURALRAYCAST_DEVICE`` chooses).
Prints one line per measurement. A fit also gives its mean |s - B| within 5 mm after the same steps from the same
start, and a variant's frame the largest difference of its picture from the run's own, so a variant that changes
the result shows it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

WARM_SECONDS = 2.0


def warmed(action: Callable[[], object], wait: Callable[[], object]) -> None:
    """``action`` repeated for WARM_SECONDS (waited for after each)."""
    began = time.perf_counter()
    while time.perf_counter() - began < WARM_SECONDS:
        action()
        wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--fit", action="store_true", help="time the SDF fit too")
    parser.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                        help="compile the field's modules with this constant too (one variant per --define)")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--frames", type=int, default=10)
    parser.add_argument("--per-thread", action="store_true",
                        help="also the frame with the networks per thread (NEURALRAYCAST_COOPVEC=0)")
    parser.add_argument("--fit-steps", type=int, default=150)
    parser.add_argument("--points", type=int, default=1 << 23)
    args = parser.parse_args()

    import os

    import numpy as np
    import slangpy as spy

    from NeuralRaycastLib.bench.kernel_clock import kernel_clock
    from NeuralRaycastLib.bench.report import timed_each
    from NeuralRaycastLib.bench.suites import fit_rate
    from NeuralRaycastLib.bench.torch_peer import band_sample
    from NeuralRaycastLib.field import field as field_module
    from NeuralRaycastLib.field.field import NeuralField
    from NeuralRaycastLib.field.sdf_fit import FitConfig, SdfFitter, band_errors
    from NeuralRaycastLib.gpu.device import open_device
    from NeuralRaycastLib.render.camera import orbit_cameras
    from NeuralRaycastLib.train.run_folder import open_run

    gpu = open_device()
    wait = gpu.device.wait
    run = open_run(gpu, args.run)
    prepared, layout = run.prepared, run.field.layout
    print(f"{gpu.backend}; geometry network {run.field.geometry_network}")

    points, reference = band_sample(prepared)  # bench_sdf_fit's points within 5 mm of a surface
    config = FitConfig(steps=100_000, batch=1 << 18, coarse_to_fine=0.0, monitor_every=1 << 30)
    low = np.asarray(layout.origin, np.float32)
    inside = low + np.random.default_rng(0).random((args.points, 3), np.float32) * np.asarray(layout.extent,
                                                                                              np.float32)
    queried = spy.Tensor.from_numpy(gpu.device, inside.reshape(-1))
    values = spy.Tensor.zeros(gpu.device, shape=(args.points * layout.kernels.structures,), dtype=float)

    def fit(label: str) -> None:
        if not args.fit:
            return
        field = NeuralField(gpu, layout, seed=0)
        fitter = SdfFitter(gpu, prepared, field, config)
        warmed(fitter.step, wait)
        field.set_parameters(layout.initial_parameters(seed=0))
        field.zero_gradients()
        fitter = SdfFitter(gpu, prepared, field, config)
        rate = fit_rate(fitter, args.fit_steps)
        with kernel_clock(gpu) as times:
            for _ in range(5):
                fitter.step()
        error = band_errors(field, points, reference, 5.0)["mean_abs_error_mm"]
        print(f"fit, {label}: {rate / 1e6:.1f} M points/s; mean |s - B| {error:.3f} mm after {args.fit_steps + 6} "
              f"steps; kernels a step: {times.per(5).summary()}")

    def queries(scene) -> str:
        """The distances at the points on the module the renderer's forward passes run (its networks' copies
        brought up to date) and on the per-thread one: device milliseconds of the kernel."""
        field = scene.field
        own = scene.forward_module(), scene.struct(scene.cooperative)["field"]
        line = []
        for label, (module, struct) in (("the run's", own), ("per thread", (field.module, field.shader_struct()))):
            def call(m=module, s=struct):
                m.distancesAt(spy.grid((args.points,)), args.points, s, queried.storage.device_address,
                              values.storage.device_address)
            warmed(call, wait)
            with kernel_clock(gpu) as times:
                for _ in range(3):
                    call()
            line.append(f"{label} {times.per(3).milliseconds.get('distancesAt', float('nan')):.2f} ms")
        return f"distances at {args.points:,} points: " + ", ".join(line)

    camera = orbit_cameras(prepared.bounds, 3, args.size, args.size)[1]

    def frames(trained) -> np.ndarray:
        renderer = trained.renderer
        picture = renderer.render(camera).rgb().copy()
        warmed(lambda: renderer.render(camera), wait)
        each = timed_each(lambda: renderer.render(camera), float("inf"), args.frames)
        with kernel_clock(gpu) as times:
            renderer.render(camera)
        print(f"  {queries(renderer.scene)}\n  {args.size}² frame median {1e3 * np.median(each):.2f} ms, fastest "
              f"{1e3 * min(each):.2f} ms; kernels {times.total_ms:.2f} ms: {times.summary()}")
        return picture

    fit("the run's own kernels")
    print("the run's own:")
    own = frames(run)
    if args.per_thread:
        os.environ["NEURALRAYCAST_COOPVEC"] = "0"
        trained = open_run(gpu, args.run)
        print(f"the networks {trained.field.geometry_network}:")
        picture = frames(trained)
        print(f"  largest difference from the run's own picture {float(np.abs(picture - own).max()):.2e}")
        del os.environ["NEURALRAYCAST_COOPVEC"]
    # A constant goes to the whole compiler session (the field's imported modules too, which a line in the module's
    # own source would not reach), and the field's modules are loaded afresh under it.
    session_defines = field_module.field_session_defines
    for item in args.define:
        name, value = item.split("=", 1)
        field_module.field_session_defines = lambda c, _extra={name: value}: {**session_defines(c), **_extra}
        field_module._MODULES.clear()
        fit(f"{name}={value}")
        print(f"{name}={value}:")
        picture = frames(open_run(gpu, args.run))
        print(f"  largest difference from the run's own picture {float(np.abs(picture - own).max()):.2e}")
        field_module.field_session_defines = session_defines
        field_module._MODULES.clear()

    return 0


if __name__ == "__main__":
    raise SystemExit(main())
