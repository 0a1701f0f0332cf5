"""The boundary maps and the run's field, in one process, three ways: the maps alone on the processor (no device: what
a process of their own would take), the maps with the device's transforms and then the field (one after the other),
and the field made beside the maps in a thread (train/field_ahead.py's NEURALRAYCAST_FIELD_BESIDE_MAPS=1). Slangpy's
native calls keep the interpreter lock for their whole length, so the field's calls hold up the maps' Python as
long.

    python3 tools/gpu/maps_field_overlap.py MODE STUDY

MODE: cpu, serial or thread. Prints the maps' wall and the wall of maps and field together (the prepared study's
arrays aside: no cache is read or written). Run each mode in a process of its own, a few times, modes taking turns.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    mode, path = sys.argv[1], sys.argv[2]
    if mode not in ("cpu", "serial", "thread"):
        raise SystemExit(f"mode {mode!r}: choose cpu, serial or thread")
    from NeuralRaycastLib.study.cache import load_study_cached
    from NeuralRaycastLib.study.preprocess import (
        StudyOutline,
        _derived_from_mask,
        import_map_libraries,
        mask_and_boundary_maps,
    )
    from NeuralRaycastLib.study.structures import make_structures

    import_map_libraries()
    study = load_study_cached(path)
    structures = make_structures(study.structures, include_brain=True, colors=study.colors)

    def quiet(message, fraction):
        return None

    if mode == "cpu":
        began = time.perf_counter()
        mask_and_boundary_maps(study, structures, quiet)
        print(f"cpu: maps {time.perf_counter() - began:.2f} s")
        return 0
    os.environ["NEURALRAYCAST_FIELD_BESIDE_MAPS"] = "1" if mode == "thread" else "0"
    from NeuralRaycastLib.gpu.device import memory_budget, open_device
    from NeuralRaycastLib.study.device_distance import maps_device
    from NeuralRaycastLib.train.field_ahead import FieldAhead
    from NeuralRaycastLib.train.phases import PhaseClock
    from NeuralRaycastLib.train.presets import RunSettings

    gpu = open_device()
    settings = RunSettings.for_device(gpu, None)
    clock = PhaseClock()
    ahead = FieldAhead(gpu, settings, memory_budget(gpu), settings.schedule(None, pretrained=True), clock)

    def outline(mask):
        return StudyOutline(study, structures, _derived_from_mask(study, mask)["bounds"])

    began = time.perf_counter()
    if mode == "serial":
        mask, _boundary, _notes = mask_and_boundary_maps(study, structures, quiet, gpu=maps_device(gpu))
    else:
        ahead.set_up_maps_kernels()
        mask, _boundary, _notes = mask_and_boundary_maps(study, structures, quiet, gpu=maps_device(gpu),
                                                         with_mask=lambda brain: ahead.start(outline(brain)))
    maps = time.perf_counter() - began
    ahead.field(outline(mask))
    ahead.close()
    beside = "; ".join(f"{phase.name} {phase.seconds:.2f} s" for phase in clock.phases)
    print(f"{mode}: maps {maps:.2f} s, maps and field {time.perf_counter() - began:.2f} s"
          + (f" ({beside} beside the maps)" if beside else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
