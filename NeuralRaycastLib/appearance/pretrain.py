"""Pretraining the latent appearance's encoder and decoder across a cohort of generated studies.

The cohort is what the project generates: the analytic phantom and the ICBM152 sample with synthetic lesions,
each with its own seed (lesion, noise, contrast). The seeds of the cohort start at :data:`COHORT_SEED_BASE`;
sample seeds below it (the sample's default 0, and every seed the tests and benchmarks use) are kept for
evaluation and never pretrained on. The target at a point is the appearance the image formation model shades
a surface with there (docs/image-formation.md): per structure the albedo from its style's channel and window,
and its specular weight as the first material. Points are drawn near the surfaces of the study's boundary maps,
where appearance is seen. The gradients are summed on the device in a fixed order (the same weights from the
same seed, run after run); Adam runs here on the few thousand parameters.

A weights file (safetensors) holds the parameters, the sizes and the cohort it was trained on.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..files import write_bytes
from ..gpu.device import GpuContext
from ..grid import sample_at
from ..progress import Progress
from ..render.style import default_structure_style
from .latent import GridLayout, LatentAppearance, LatentConfig

COHORT_SEED_BASE = 1000  # sample seeds below this are evaluation seeds: never in a cohort
CHANNEL_SLOTS = 4  # the encoder's MRI channel inputs; P(x) follows them (LatentConfig.inputs = 5)
WEIGHTS_FORMAT = "neuralraycast-latent-appearance"
WEIGHTS_VERSION = 1
WEIGHTS_KEY = "neuralraycast"
MAX_WEIGHTS_BYTES = 5 * 2**20
#: The weights the package ships: ``neuralraycast pretrain --out FILE --studies 16 --seed 0`` (the defaults
#: otherwise) on a GPU; the file's metadata says how it was made.
SHIPPED_WEIGHTS = Path(__file__).with_name("pretrained.safetensors")


class WeightsFileError(ValueError):
    """A pretrained weights file that cannot be used; the message says which file and why."""


@dataclass(frozen=True)
class PretrainConfig:
    """``studies`` of the cohort (the phantom first), ``seed`` of the cohort's sample seeds, of the points drawn
    and of the initial weights; ``max_voxels``: each study downsampled so no axis is longer."""

    studies: int = 4
    seed: int = 0
    steps: int = 600
    batch: int = 4096
    rate: float = 3e-3
    max_voxels: int = 96
    band_mm: float = 4.0

    def check(self) -> PretrainConfig:
        if self.studies < 1 or self.steps < 1 or self.batch < 1 or self.seed < 0:
            raise ValueError("pretraining needs at least one study, step and point a step, and a seed >= 0 "
                             f"(got studies {self.studies}, steps {self.steps}, batch {self.batch}, seed {self.seed})")
        if not (self.rate > 0 and self.band_mm > 0 and self.max_voxels >= 16):
            raise ValueError("pretraining needs a positive rate and band, and max_voxels >= 16")
        return self


def cohort(studies: int, seed: int) -> list[tuple[str, int]]:
    """(case, sample seed) of each study: the phantom, then ICBM152 samples, all on seeds past the evaluation
    seeds and distinct for distinct pretraining seeds."""
    base = COHORT_SEED_BASE + 1000 * seed
    return [("phantom" if index == 0 else "icbm", base + index) for index in range(studies)]


def latent_inputs(prepared) -> list[np.ndarray]:
    """The encoder's inputs of a prepared study, (5, I, J, K) in all, as the volumes that make them up in order:
    its normalised channels in the first slots (zeros where it has fewer), then P(x). Kept apart, so that they go
    to the device without being joined on the host first (render/volume.py's interleaved_volumes takes them so)."""
    channels = np.asarray(prepared.channels, np.float32)
    if channels.shape[0] > CHANNEL_SLOTS:
        raise ValueError(f"the pretrained appearance takes at most {CHANNEL_SLOTS} channels "
                         f"(the study has {channels.shape[0]})")
    missing = CHANNEL_SLOTS - channels.shape[0]
    empty = [np.zeros((missing, *channels.shape[1:]), np.float32)] if missing else []
    return [channels, *empty, np.asarray(prepared.probability, np.float32)]


def default_config(structures: int = 4, materials: int = 2) -> LatentConfig:
    return LatentConfig(inputs=CHANNEL_SLOTS + 1, structures=structures, materials=materials)


def target_appearance(prepared, points: np.ndarray, materials: int) -> np.ndarray:
    """(N, K·(3+M)): per structure the albedo its default style gives at the points (the reference renderer's)
    and its specular weight as the first material (the others 0)."""
    channels = sample_at(prepared.channels, prepared.affine, points)  # (C, N)
    names = list(prepared.channel_names)
    targets = np.zeros((len(points), len(prepared.structures), 3 + materials), np.float32)
    for k, structure in enumerate(prepared.structures):
        style = default_structure_style(structure.name, names)
        color = np.asarray(style.color or structure.color, np.float64)
        if style.channel is None:
            shade = np.ones(len(points))
        else:
            low, high = style.window
            windowed = np.clip((channels[names.index(style.channel)] - low) / max(high - low, 1e-6), 0.0, 1.0)
            shade = (1.0 - style.modulation) + style.modulation * windowed
        targets[:, k, :3] = color[None, :] * shade[:, None]
        targets[:, k, 3] = style.specular
    return targets.reshape(len(points), -1)


def output_weights(structures: int, materials: int) -> np.ndarray:
    """Which outputs pretraining fits: every albedo and the specular weight (the other materials are unused)."""
    weights = np.zeros((structures, 3 + materials), np.float32)
    weights[:, :4] = 1.0
    return weights.reshape(-1)


class CohortStudy:
    """A prepared study of the cohort on the device: its inputs, and where points near its surfaces are drawn."""

    def __init__(self, gpu: GpuContext, prepared, band_mm: float) -> None:
        from ..render.volume import interleaved_volumes

        self.prepared = prepared
        self._volumes, self.inputs = interleaved_volumes(gpu, latent_inputs(prepared), np.linalg.inv(prepared.affine))
        near = np.min(np.abs(prepared.boundary), axis=0) < band_mm
        self.voxels = np.argwhere(near).astype(np.float64)
        if len(self.voxels) == 0:
            raise ValueError("a cohort study has no surface")

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """RAS points (count, 3) near the study's surfaces."""
        ijk = self.voxels[rng.integers(0, len(self.voxels), count)] + rng.uniform(-0.5, 0.5, (count, 3))
        affine = np.asarray(self.prepared.affine, np.float64)
        return ijk @ affine[:3, :3].T + affine[:3, 3]


def cohort_jobs(studies: int) -> int:
    """Processes that generate and prepare the cohort side by side: a study takes seconds of one core (generating
    and writing its volumes), so a larger cohort is made in about one study's time where there are cores."""
    return max(1, min(studies, (os.cpu_count() or 1) // 2))


def prepare_cohort_study(case: str, seed: int, folder: Path, max_voxels: int):
    """One study of the cohort, generated in ``folder``, downsampled to ``max_voxels`` a side and prepared."""
    from ..study.cache import load_study_cached
    from ..study.preprocess import prepare
    from ..study.sample import write_sample
    from ..study.study import downsample_study

    manifest = write_sample(folder / f"{case}_{seed}", case, seed=seed)
    return prepare(downsample_study(load_study_cached(manifest), max_voxels))


def prepare_cohort(config: PretrainConfig, folder: Path, progress: Progress | None = None,
                   jobs: int | None = None) -> list:
    """Generate and prepare the cohort's studies (downsampled to ``max_voxels`` a side) in ``folder``, in
    ``jobs`` processes at once (default :func:`cohort_jobs`); each study depends on its own case and seed only, so
    the cohort is the same however many make it."""
    members = cohort(config.studies, config.seed)
    jobs = cohort_jobs(len(members)) if jobs is None else max(1, jobs)

    def report(done: int, case: str, seed: int) -> None:
        if progress is not None:
            progress(f"cohort study {done}/{config.studies}: {case}, seed {seed}", done / config.studies)

    if jobs == 1:
        prepared = []
        for index, (case, seed) in enumerate(members):
            prepared.append(prepare_cohort_study(case, seed, folder, config.max_voxels))
            report(index + 1, case, seed)
        return prepared
    # Fresh interpreters, not forks: the parent may hold a GPU device already.
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(prepare_cohort_study, case, seed, folder, config.max_voxels): (case, seed)
                   for case, seed in members}
        for done, future in enumerate(as_completed(futures), 1):
            report(done, *futures[future])
        return [future.result() for future in futures]  # in the cohort's order


@dataclass
class PretrainResult:
    parameters: np.ndarray
    config: LatentConfig
    pretrain: PretrainConfig
    losses: list[float]  # the mean loss of each step


def pretrain_on(gpu: GpuContext, prepared: list, config: PretrainConfig, latent: LatentConfig | None = None,
                progress: Progress | None = None) -> PretrainResult:
    """Fit the encoder and decoder to the target appearance of these prepared studies (Adam, fixed seed)."""
    import slangpy as spy

    config.check()
    structures = {len(p.structures) for p in prepared}
    if len(structures) != 1:
        raise ValueError(f"the cohort's studies must have one number of structures (got {sorted(structures)})")
    latent = latent or default_config(structures.pop())
    rng = np.random.default_rng(config.seed)
    box = np.asarray(prepared[0].bounds)
    appearance = LatentAppearance(gpu, latent, GridLayout.over(box, float(np.max(box[1] - box[0]))),
                                  seed=config.seed)
    studies = [CohortStudy(gpu, p, config.band_mm) for p in prepared]
    device, batch = gpu.device, config.batch
    weights = spy.Tensor.from_numpy(device, output_weights(latent.structures, latent.materials))
    losses_out = spy.Tensor.zeros(device, shape=(batch,), dtype=float)
    rows = spy.Tensor.zeros(device, shape=(batch * latent.count,), dtype=float)
    values = appearance.parameters().astype(np.float64)
    m, v = np.zeros_like(values), np.zeros_like(values)
    beta1, beta2, losses = 0.9, 0.99, []
    for step in range(config.steps):
        study = studies[step % len(studies)]
        points = study.draw(rng, batch)
        views = rng.normal(size=(batch, 3))
        views /= np.linalg.norm(views, axis=1, keepdims=True)
        targets = target_appearance(study.prepared, points, latent.materials)
        uploaded = [spy.Tensor.from_numpy(device, np.ascontiguousarray(a, np.float32).reshape(-1))
                    for a in (points, views, targets)]
        appearance.module.latentPretrainStep(
            spy.grid((batch,)), batch, appearance.shader_struct(grid_gradients=False), study.inputs,
            *(t.storage.device_address for t in uploaded), weights.storage.device_address, 1.0 / batch,
            rows.storage.device_address, latent.count, losses_out.storage.device_address)
        appearance.module.latentSumRows(spy.grid((latent.count,)), latent.count, batch, rows.storage.device_address,
                                        appearance.grads.storage.device_address)
        losses.append(float(np.asarray(losses_out.to_numpy(), np.float64).mean()))
        gradient = appearance.gradients().astype(np.float64)
        rate = config.rate * (0.1 ** (step / config.steps))  # decays tenfold over the run
        m = beta1 * m + (1 - beta1) * gradient
        v = beta2 * v + (1 - beta2) * gradient**2
        values -= rate * (m / (1 - beta1 ** (step + 1))) / (np.sqrt(v / (1 - beta2 ** (step + 1))) + 1e-8)
        appearance.set_parameters(values.astype(np.float32))
        if progress is not None and (step % 50 == 0 or step == config.steps - 1):
            progress(f"pretraining step {step + 1}/{config.steps}: loss {losses[-1]:.5f}", (step + 1) / config.steps)
    return PretrainResult(values.astype(np.float32), latent, config, losses)


def pretrain(gpu: GpuContext, config: PretrainConfig, progress: Progress | None = None,
             work: Path | None = None) -> PretrainResult:
    """Generate the cohort (in ``work``, else a temporary folder) and pretrain on it."""
    config.check()
    if work is not None:
        return pretrain_on(gpu, prepare_cohort(config, Path(work), progress), config, progress=progress)
    with tempfile.TemporaryDirectory(prefix="neuralraycast-cohort-") as folder:
        prepared = prepare_cohort(config, Path(folder), progress)
    return pretrain_on(gpu, prepared, config, progress=progress)


def weights_bytes(result: PretrainResult) -> bytes:
    """The weights file: the parameters with the sizes, the cohort and a digest as metadata."""
    from safetensors.numpy import save

    parameters = np.ascontiguousarray(result.parameters, np.float32)
    metadata = {
        "format": WEIGHTS_FORMAT, "version": WEIGHTS_VERSION, "latent": result.config.as_dict(),
        "pretrain": asdict(result.pretrain), "cohort": cohort(result.pretrain.studies, result.pretrain.seed),
        "first_loss": result.losses[0] if result.losses else None,
        "final_loss": result.losses[-1] if result.losses else None,
        "sha256": hashlib.sha256(parameters.tobytes()).hexdigest(),
    }
    return save({"parameters": parameters}, metadata={WEIGHTS_KEY: json.dumps(metadata)})


def write_weights(path: str | Path, result: PretrainResult) -> Path:
    data = weights_bytes(result)
    if len(data) > MAX_WEIGHTS_BYTES:
        raise ValueError(f"the weights would take {len(data)} bytes, more than {MAX_WEIGHTS_BYTES}")
    return write_bytes(path, data)


def read_weights(path: str | Path) -> tuple[LatentConfig, np.ndarray, dict[str, Any]]:
    """(sizes, parameters, metadata) of a weights file, every part checked: a damaged, foreign or altered file is
    refused with a WeightsFileError naming it."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise WeightsFileError(f"{path}: no such weights file; make one with 'neuralraycast pretrain --out {path}'")
    try:
        with safe_open(str(path), framework="numpy") as handle:
            metadata = json.loads((handle.metadata() or {})[WEIGHTS_KEY])
            parameters = np.asarray(handle.get_tensor("parameters"), np.float32)
    except Exception as error:  # damaged headers and short files raise several types
        raise WeightsFileError(f"{path}: not a pretrained appearance weights file ({error})") from error
    if metadata.get("format") != WEIGHTS_FORMAT or metadata.get("version") != WEIGHTS_VERSION:
        raise WeightsFileError(f"{path}: not a weights file of version {WEIGHTS_VERSION} of {WEIGHTS_FORMAT}")
    try:
        config = LatentConfig.from_dict(metadata["latent"])
    except (KeyError, TypeError, ValueError) as error:
        raise WeightsFileError(f"{path}: {error}") from error
    digest = hashlib.sha256(parameters.tobytes()).hexdigest()
    if parameters.shape != (config.count,) or digest != metadata.get("sha256"):
        raise WeightsFileError(f"{path}: the parameters do not match the file's sizes and digest (altered or damaged)")
    return config, parameters, metadata
