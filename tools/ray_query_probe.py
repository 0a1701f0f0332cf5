"""Whether a device traces rays through a hardware acceleration structure from a compute kernel (an inline ray
query over procedural boxes, tools/ray_query_probe.slang), as a Gaussian renderer would find the Gaussians a ray
segment meets: the structure's build time, each ray's count of boxes met against a slab test on the host, and
the queries' time; then for which targets Slang compiles the kernel (offline, as Testing/test_shader_targets.py
compiles the project's). Slang's CUDA target has no inline ray queries: on CUDA the same search needs a
ray-tracing pipeline (OptiX), and the last lines say so.

Usage: python tools/ray_query_probe.py [boxes] [rays]   (on the Vulkan device: lavapipe or a GPU's driver)"""

import sys
import time
from pathlib import Path

import numpy as np
import slangpy as spy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from NeuralRaycastLib.gpu import shader_targets  # noqa: E402

SOURCE = Path(__file__).with_name("ray_query_probe.slang")
SEGMENT = 40.0  # each ray's segment, in the boxes' units (they lie in a 50-unit cube)


def build(device: spy.Device, desc: spy.AccelerationStructureBuildDesc,
          kind: spy.AccelerationStructureKind) -> spy.AccelerationStructure:
    sizes = device.get_acceleration_structure_sizes(desc)
    scratch = device.create_buffer(size=sizes.scratch_size, usage=spy.BufferUsage.unordered_access)
    structure = device.create_acceleration_structure(kind=kind, size=sizes.acceleration_structure_size)
    encoder = device.create_command_encoder()
    encoder.build_acceleration_structure(desc=desc, dst=structure, src=None, scratch_buffer=scratch)
    device.submit_command_buffer(encoder.finish())
    device.wait()
    return structure


def boxes_scene(device: spy.Device, boxes: np.ndarray) -> tuple[spy.AccelerationStructure, list]:
    """A top-level structure over one bottom-level structure of the (N, 6) boxes (low corner, high corner); the
    buffers it was built from, to keep alive with it."""
    buffer = device.create_buffer(usage=spy.BufferUsage.shader_resource, data=np.ascontiguousarray(boxes, np.float32))
    primitives = spy.AccelerationStructureBuildInputProceduralPrimitives()
    primitives.aabb_buffers = [spy.BufferOffsetPair(buffer)]
    primitives.aabb_stride = 24
    primitives.primitive_count = len(boxes)
    primitives.flags = spy.AccelerationStructureGeometryFlags.no_duplicate_any_hit_invocation
    bottom = build(device, spy.AccelerationStructureBuildDesc({"inputs": [primitives]}),
                   spy.AccelerationStructureKind.bottom_level)
    instances = device.create_acceleration_structure_instance_list(1)
    instances.write(0, {"transform": spy.float3x4.identity(), "instance_id": 0, "instance_mask": 0xFF,
                        "instance_contribution_to_hit_group_index": 0,
                        "flags": spy.AccelerationStructureInstanceFlags.none, "acceleration_structure": bottom.handle})
    top = build(device, spy.AccelerationStructureBuildDesc({"inputs": [instances.build_input_instances()]}),
                spy.AccelerationStructureKind.top_level)
    return top, [buffer, bottom, instances]


def slab_counts(origins: np.ndarray, directions: np.ndarray, boxes: np.ndarray, chunk: int = 256) -> np.ndarray:
    """Each ray's count of boxes its segment [0, SEGMENT] meets, by the slab test (rays in chunks: bounded memory)."""
    counts = []
    for first in range(0, len(origins), chunk):
        o, d = origins[first : first + chunk, None], directions[first : first + chunk, None]
        with np.errstate(divide="ignore"):
            t1, t2 = (boxes[None, :, :3] - o) / d, (boxes[None, :, 3:] - o) / d
        near, far = np.minimum(t1, t2).max(axis=2), np.maximum(t1, t2).min(axis=2)
        counts.append(((near <= far) & (far >= 0.0) & (near <= SEGMENT)).sum(axis=1))
    return np.concatenate(counts)


def main() -> int:
    boxes_count = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    rays_count = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    device = spy.create_device(type=spy.DeviceType.vulkan, include_paths=[str(SOURCE.parent)])
    features = [str(f).split(".")[-1] for f in device.features if "ray" in str(f)]
    print(f"{device.info.adapter_name}: ray features {features or 'none'}")
    rng = np.random.default_rng(0)
    low = rng.uniform(0.0, 50.0, (boxes_count, 3))
    boxes = np.concatenate([low, low + rng.uniform(0.5, 3.0, (boxes_count, 3))], axis=1).astype(np.float32)
    started = time.perf_counter()
    scene, _keep = boxes_scene(device, boxes)
    print(f"{boxes_count:,} boxes: structure built in {time.perf_counter() - started:.3f} s")
    origins = rng.uniform(-5.0, 0.0, (rays_count, 3)).astype(np.float32)
    directions = np.abs(rng.normal(size=(rays_count, 3)))
    directions = (directions / np.linalg.norm(directions, axis=1, keepdims=True)).astype(np.float32)
    rays = spy.Tensor.from_numpy(device, np.ascontiguousarray(np.concatenate([origins, directions], 1).reshape(-1)))
    counts = spy.Tensor.zeros(device, shape=(rays_count,), dtype="int")
    module = spy.Module.load_from_file(device, str(SOURCE))
    for _ in range(2):  # the first compiles the kernel
        started = time.perf_counter()
        module.countHits(spy.grid((rays_count,)), scene, rays.storage.device_address, SEGMENT,
                         counts.storage.device_address)
        device.wait()
        seconds = time.perf_counter() - started
    found = np.asarray(counts.to_numpy())
    expected = slab_counts(origins.astype(np.float64), directions.astype(np.float64), boxes.astype(np.float64))
    print(f"{rays_count:,} rays: {seconds * 1e3:.2f} ms, {found.mean():.2f} boxes a ray (slab test "
          f"{expected.mean():.2f}); rays whose count differs: {int((found != expected).sum())}")
    for target in ("spirv", "cuda", "metal", "hlsl"):
        failures = shader_targets.compile_source("ray_query_probe", SOURCE.read_text(), ("countHits",), target, {})
        print(f"{target}: " + ("compiles" if not failures else failures[0].error))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
