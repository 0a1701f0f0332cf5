"""The rows of `neuralraycast bench --json` output (each a dict with "metric" and "value"), wherever they sit in
its nesting; read by the GPU scripts' summaries (coopvec.sh, coopvec_train.sh)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def rows(data: Any) -> Iterator[dict]:
    """Every bench row in ``data`` (parsed JSON), depth first."""
    if isinstance(data, dict):
        if "metric" in data and "value" in data:
            yield data
        for value in data.values():
            yield from rows(value)
    elif isinstance(data, list):
        for value in data:
            yield from rows(value)
