"""The start-up probe behind ``bench --suite startup``: a run's start timed in a fresh process."""

from __future__ import annotations

import pytest

from NeuralRaycastLib.startup import MILESTONES, timed_start


@pytest.mark.gpu
def test_start_up_milestones_in_a_fresh_process(tmp_path, gpu):
    from NeuralRaycastLib.sample import write_sample

    study = write_sample(tmp_path / "s", "fixture")
    result = timed_start(study, "quick", gpu.backend)
    seconds = [result["seconds"][name] for name in MILESTONES]
    assert result["preset"] == "quick"
    assert seconds[0] > 0 and all(a <= b for a, b in zip(seconds, seconds[1:], strict=False)), seconds


def test_a_failing_probe_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="start-up probe failed"):
        timed_start(tmp_path / "no-such-study")
