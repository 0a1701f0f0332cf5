"""The benchmark report's rows that are computed rather than timed."""

from __future__ import annotations

import math

from NeuralRaycastLib.bench import memory_row


def test_memory_row_reports_the_largest_sample_and_lists_them_all():
    row = memory_row({"field and trainer made": 3 << 30, "training done": 5 << 30, "1024² renders": None,
                      "512² renders": 4 << 30})
    assert row.value == 5.0 and row.unit == "GiB"
    assert row.notes.startswith("after training done;")
    assert "field and trainer made 3.00" in row.notes and "512² renders 4.00" in row.notes
    assert "1024²" not in row.notes


def test_memory_row_says_when_the_device_does_not_tell():
    row = memory_row({"training done": None})
    assert math.isnan(row.value) and "not readable" in row.notes
