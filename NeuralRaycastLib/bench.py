"""``neuralraycast bench``: speed measurements on the current device, as Markdown for BENCHMARKS.md.

Targets are checked here, never in timed tests. Each suite returns rows of (metric, value, unit, notes).
"""

from __future__ import annotations

import datetime
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from .gpu import GpuContext


@dataclass
class BenchRow:
    suite: str
    metric: str
    value: float
    unit: str
    notes: str = ""


@dataclass
class BenchReport:
    date: str
    device: dict
    command: str
    study: str
    rows: list[BenchRow] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)

    def markdown(self) -> str:
        lines = [
            f"### {self.date} · {self.device['adapter']} ({self.device['backend']})",
            "",
            f"Command: `{self.command}`  ",
            f"Study: {self.study}  ",
            f"slangpy {self.device['slangpy_version']}, Python {self.device['python_version']}, "
            f"{platform.system()} {platform.machine()}",
            "",
            "| suite | metric | value | unit | notes |",
            "|---|---|---:|---|---|",
        ]
        lines += [f"| {r.suite} | {r.metric} | {r.value:.4g} | {r.unit} | {r.notes} |" for r in self.rows]
        return "\n".join(lines) + "\n"


def timed(function: Callable[[], object], min_seconds: float, max_repeats: int) -> tuple[float, int]:
    """Seconds per call over repeated calls (at least one, until ``min_seconds`` or ``max_repeats``)."""
    count, start = 0, time.perf_counter()
    while True:
        function()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds or count >= max_repeats:
            return elapsed / count, count


def bench_reference(gpu: GpuContext, prepared, quick: bool, progress) -> list[BenchRow]:
    """Reference images per second (render + read-back) at 512² and 1024², without and with shadows."""
    from .camera import orbit_cameras
    from .render import ReferenceRenderer, hybrid_shadows

    renderer = ReferenceRenderer(gpu, prepared)
    start = time.perf_counter()
    mesh = hybrid_shadows(gpu, prepared, renderer.style)
    build = time.perf_counter() - start
    rows = [BenchRow("reference", "meshes + BVH for hybrid shadows", build, "s",
                     f"{mesh.bvh.triangle_count} triangles, marching cubes on the CPU")]
    modes = {"no shadows": {"shadows": False}, "volumetric shadows": {"shadows": True},
             "mesh shadows": {"mesh_shadows": mesh}}
    for size in (512, 1024):
        camera = orbit_cameras(prepared.bounds, 3, size, size)[1]
        for label, options in modes.items():
            progress(f"reference {size}² {label}", 0.0)
            first = time.perf_counter()
            renderer.render(camera, **options)  # compiles on first use
            first = time.perf_counter() - first
            seconds, repeats = timed(lambda c=camera, o=options: renderer.render(c, **o),
                                     0.5 if quick else 3.0, 3 if quick else 50)
            rows.append(BenchRow("reference", f"images/s {size}² {label}", 1.0 / seconds, "1/s",
                                 f"{seconds * 1e3:.1f} ms each, {repeats} runs; first {first:.2f} s"))
    return rows


SUITES: dict[str, Callable] = {"reference": bench_reference}


def run_bench(gpu: GpuContext, prepared, study_name: str, suites: list[str], quick: bool, command: str,
              progress=None) -> BenchReport:
    report = progress or (lambda message, fraction: None)
    unknown = set(suites) - set(SUITES)
    if unknown:
        raise ValueError(f"unknown benchmark suite(s) {sorted(unknown)}; choose from {sorted(SUITES)}")
    result = BenchReport(
        date=datetime.date.today().isoformat(), device=gpu.report.as_dict(), command=command, study=study_name
    )
    for suite in suites:
        result.rows += SUITES[suite](gpu, prepared, quick, report)
    report("done", 1.0)
    return result
