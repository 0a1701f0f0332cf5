"""A first run prints no shader-compiler warnings: the kernels compile clean, and what slangpy still has to
say goes to a log file in the cache folder rather than into the user's terminal or Slicer's log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Every shader module the runtime loads by name (gpu.load_module), and the field's generated module.
RUNTIME_MODULES = ("adam", "bvh", "composite", "distance_transform", "image_loss", "mesh_distance", "mesh_shadows",
                   "ray_samples", "reference_render", "segment_lists", "segment_shadows", "volume_upload")

LOAD_EVERY_MODULE = f"""
import numpy as np
from NeuralRaycastLib.field.field import FieldLayout, field_config_for, load_field_module
from NeuralRaycastLib.gpu.device import open_device
gpu = open_device()
for name in {RUNTIME_MODULES!r}:
    gpu.load_module(name, 3)
layout = FieldLayout.build(field_config_for(2.0, small=True), np.array([[0, 0, 0], [40, 40, 40]], float), 3, 2)
load_field_module(gpu, layout)
print("all modules loaded")
# Kernels are built when first called: a short training builds every one a run calls.
import sys
sys.path.insert(0, {str(ROOT / "Testing")!r})
from test_study_kernels import phantom_study, train
train(gpu, phantom_study(("brain", "whole_tumor", "tumor_core"), channels=2))
print("trained")
"""


def environment(tmp_path: Path) -> dict[str, str]:
    """This process's environment with an empty cache, the project first on the path (keeping the rest of the
    path, where packages may come from)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "NEURALRAYCAST_CACHE": str(tmp_path / "cache"), "PYTHONPATH": path}


@pytest.mark.gpu
def test_a_first_run_compiles_every_module_and_kernel_without_a_warning(tmp_path):
    """With an empty cache every module is compiled from its source, and every kernel of a training built, as on
    a user's first run."""
    done = subprocess.run([sys.executable, "-c", LOAD_EVERY_MODULE], capture_output=True, text=True,
                          env=environment(tmp_path), cwd=tmp_path, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "all modules loaded" in output and "trained" in output
    assert "warning" not in output.lower(), output
    log = tmp_path / "cache" / "logs" / "slangpy.log"
    compiler_warnings = [line for line in log.read_text().splitlines() if "warning[" in line] if log.exists() else []
    assert not compiler_warnings, "\n".join(compiler_warnings)  # fixed, not only hidden


ROUTE_A_WARNING = """
import slangpy as spy
from NeuralRaycastLib.gpu.compiler_log import log_path, route_slangpy_messages
route_slangpy_messages()
spy.Logger.get().warn("warning[E0000]: a compiler note for the log")
spy.Logger.get().error("a failure the user must see")
print(log_path())
"""


def test_slangpy_warnings_go_to_the_log_file_and_errors_to_the_user(tmp_path):
    done = subprocess.run([sys.executable, "-c", ROUTE_A_WARNING], capture_output=True, text=True,
                          env=environment(tmp_path), cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    log = Path(done.stdout.strip().splitlines()[-1])
    assert log == tmp_path / "cache" / "logs" / "slangpy.log"
    written = log.read_text()
    assert "WARN" in written and "a compiler note for the log" in written and "a failure the user must see" in written
    assert "a compiler note" not in done.stdout + done.stderr  # not in the terminal
    assert "a failure the user must see" in done.stderr  # errors still reach the user, through logging
