"""Where the GPU memory of `bench --suite train` goes: the memory in use after each of its steps (the standard
preset's training, the learned meshes for shadows, the neural render at 512² and 1024², the reference
renderer), and what is given back when the renderer's sample buffers, the reference renderer and the mesh
shadows are let go. CUDA only (the device's total less free), with the bytes of the buffers the device's heaps
hold and of the pages they sit in (docs/gpu-memory.md says why those differ).

    python3 tools/gpu/memory_steps.py [--gpu-memory 6G] [--preset standard] [--allocations]
"""

from __future__ import annotations

import argparse
import gc


def held(renderer) -> None:
    """The renderer's sample buffers (no reference kept: a held batch would stay on the device)."""
    batch = renderer._batch
    if batch is not None:
        print(f"    batch: capacity {batch.capacity:,} rays, slots {batch.slot_capacity:,}, "
              f"surfaces {batch.surface_capacity:,}; bands {renderer.band_work}")


def freed(gpu, step) -> None:
    """Whether a buffer let go gives its memory back to the device at once, after a wait for the device, or
    after a submit."""
    import slangpy as spy

    tensor = spy.Tensor.zeros(gpu.device, shape=(1 << 28,), dtype="float")
    step("a 1 GiB tensor made")
    del tensor
    step("  let go")
    gpu.device.wait_for_idle()
    step("  after wait_for_idle")
    encoder = gpu.device.create_command_encoder()
    gpu.device.submit_command_buffer(encoder.finish())
    gpu.device.wait_for_idle()
    step("  after a submit")


def trace_allocations(gpu, least: int = 32 << 20) -> None:
    """Print every tensor of ``least`` bytes or more made from here on, with the heaps' pages it added (0: it
    took room in a page made before) and where in the project it was made."""
    import traceback

    import slangpy as spy

    def traced(make):
        def made(*args, **kwargs):
            before = sum(heap.total_mem_usage for heap in gpu.device.report_heaps())
            tensor = make(*args, **kwargs)
            size = tensor.storage.size
            if size >= least:
                added = sum(heap.total_mem_usage for heap in gpu.device.report_heaps()) - before
                caller = next((f"{frame.filename.split('NeuralRaycastLib/')[-1]}:{frame.lineno} {frame.name}"
                               for frame in reversed(traceback.extract_stack()[:-1])
                               if "NeuralRaycastLib" in frame.filename), "?")
                print(f"      made {size / 2**20:8.0f} MiB, pages {added / 2**20:+6.0f} MiB  {caller}", flush=True)
            return tensor
        return staticmethod(made)

    spy.Tensor.zeros = traced(spy.Tensor.zeros)
    spy.Tensor.zeros_like = traced(spy.Tensor.zeros_like)
    spy.Tensor.empty = traced(spy.Tensor.empty)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-memory", default=None)
    parser.add_argument("--preset", default="standard")
    parser.add_argument("--allocations", action="store_true",
                        help="print every tensor of 32 MiB or more made, with the heap pages it added")
    args = parser.parse_args()

    from NeuralRaycastLib.field.field import NeuralField
    from NeuralRaycastLib.gpu.device import device_memory_in_use, open_device
    from NeuralRaycastLib.render.camera import orbit_cameras
    from NeuralRaycastLib.render.reference_render import ReferenceRenderer
    from NeuralRaycastLib.study.sample import cached_sample
    from NeuralRaycastLib.study.study import load_study
    from NeuralRaycastLib.train.presets import RunSettings
    from NeuralRaycastLib.train.run_folder import prepare_for_run, reference_views_for_run
    from NeuralRaycastLib.train.trainer import Trainer, learned_mesh_shadows

    gpu = open_device(None, args.gpu_memory)
    last = [0]

    def step(name: str) -> None:
        gc.collect()
        used = device_memory_in_use(gpu) or 0
        heaps = gpu.device.report_heaps()  # (CUDA: the buffers held, and the pages they sit in)
        held = sum(heap.total_allocated for heap in heaps) / 2**30
        pages = sum(heap.total_mem_usage for heap in heaps) / 2**30
        print(f"{used / 2**30:6.2f} GiB ({(used - last[0]) / 2**20:+8.0f} MiB; buffers {held:5.2f} GiB in pages of "
              f"{pages:5.2f} GiB)  {name}", flush=True)
        last[0] = used

    step("device open")
    freed(gpu, step)
    if args.allocations:
        trace_allocations(gpu)
    settings = RunSettings.for_device(gpu, args.preset)
    study = load_study(cached_sample("icbm"))
    prepared = prepare_for_run(study, settings)
    step("study prepared")
    views = reference_views_for_run(gpu, prepared, settings)
    step(f"reference views ({len(views.images)})")
    field = NeuralField(gpu, settings.field_layout(gpu, prepared), seed=settings.seed)
    trainer = Trainer(gpu, prepared, field, views, settings.schedule())
    step("field and trainer made")
    log = trainer.run()
    step(f"training done ({log.seconds:.1f} s)")
    held(trainer.renderer)
    shadows = learned_mesh_shadows(gpu, prepared, field, trainer.style)
    step("learned meshes for shadows")
    trainer.use_picture_settings()
    step("picture settings")
    renderer = trainer.renderer
    trainer.renderer.release_batch()
    step("renderer's batch let go")
    reference = ReferenceRenderer(gpu, prepared)
    for width in (512, 1024):
        camera = orbit_cameras(prepared.bounds, 3, width, width)[1]
        renderer.set_mesh_shadows(None)
        for _ in range(3):
            renderer.render(camera)
        step(f"neural {width}², no shadows")
        renderer.set_mesh_shadows(shadows)
        for _ in range(3):
            renderer.render(camera)
        step(f"neural {width}², mesh shadows")
        held(renderer)
        reference.render(camera, shadows=True)
        step(f"reference {width}²")
    del reference
    step("reference renderer let go")
    renderer.set_mesh_shadows(None)
    del shadows
    step("mesh shadows let go")
    renderer.release_batch()
    step("renderer's batch let go")
    renderer._frame = renderer._planes = renderer._picture = None
    step("frame buffers let go")
    freed(gpu, step)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
