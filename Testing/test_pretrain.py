"""``neuralraycast pretrain``: the pretrained appearance's weights file, fitted across a generated cohort that
holds no evaluation seed, small, the same bytes from the same seed, and refused when altered."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest

from NeuralRaycastLib.app.cli import main
from NeuralRaycastLib.appearance.pretrain import (
    COHORT_SEED_BASE,
    MAX_WEIGHTS_BYTES,
    SHIPPED_WEIGHTS,
    PretrainConfig,
    WeightsFileError,
    cohort,
    read_weights,
)

SMOKE = ["--studies", "1", "--steps", "40", "--batch", "512"]


def test_the_cohort_holds_no_evaluation_seed_and_differs_by_seed():
    first, second = cohort(5, 0), cohort(5, 1)
    assert first[0][0] == "phantom" and {case for case, _ in first[1:]} == {"icbm"}
    seeds = [seed for _, seed in first + second]
    assert min(seeds) >= COHORT_SEED_BASE and len(set(seeds)) == len(seeds)


def test_the_shipped_weights_are_small_sound_and_say_the_command_that_makes_them():
    """``pretrain --out FILE --studies 3 --seed 0``, the other settings the defaults."""
    assert SHIPPED_WEIGHTS.stat().st_size <= MAX_WEIGHTS_BYTES
    config, parameters, metadata = read_weights(SHIPPED_WEIGHTS)
    assert np.isfinite(parameters).all() and config.inputs == 5 and config.structures == 4
    assert metadata["pretrain"] == asdict(PretrainConfig(studies=3, seed=0))
    assert metadata["cohort"] == [list(study) for study in cohort(3, 0)]
    assert metadata["final_loss"] < 0.01


@pytest.mark.gpu
def test_pretrain_writes_small_weights_that_the_same_seed_reproduces(tmp_path, capsys):
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert main(["pretrain", "--out", str(first), *SMOKE]) == 0
    assert main(["pretrain", "--out", str(second), *SMOKE]) == 0
    assert str(second) in capsys.readouterr().out
    assert first.read_bytes() == second.read_bytes()
    assert first.stat().st_size <= MAX_WEIGHTS_BYTES
    config, parameters, metadata = read_weights(first)
    assert parameters.shape == (config.count,) and np.isfinite(parameters).all()
    assert config.inputs == 5 and config.structures == 4
    assert metadata["cohort"] == [["phantom", COHORT_SEED_BASE]]
    assert metadata["final_loss"] < 0.6 * metadata["first_loss"]  # it learns

    # An existing weights file is kept unless --overwrite is given; the one line says so and names it.
    before = first.read_bytes()
    assert main(["pretrain", "--out", str(first), *SMOKE]) == 2
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and str(first) in message and "--overwrite" in message
    assert first.read_bytes() == before

    # An altered weights file is refused by name, never half-loaded.
    data = bytearray(before)
    data[-5] ^= 0x40
    altered = tmp_path / "altered.safetensors"
    altered.write_bytes(bytes(data))
    with pytest.raises(WeightsFileError, match="altered.safetensors"):
        read_weights(altered)
    with pytest.raises(WeightsFileError, match="neuralraycast pretrain"):
        read_weights(tmp_path / "missing.safetensors")
