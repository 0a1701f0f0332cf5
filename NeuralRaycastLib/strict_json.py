"""JSON that strict parsers accept: Python writes a NaN or an infinity as bare ``NaN`` / ``Infinity``, which
other parsers refuse, and metrics can hold them (a score with nothing to score, identical pictures). They are
written as null, a value that is missing; anything else that is not finite fails loudly instead of slipping
through."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(data: Any) -> Any:
    """``data`` with every non-finite float (in dicts, lists and tuples) replaced by None."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: finite(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite(value) for value in data]
    return data


def dumps(data: Any, **options: Any) -> str:
    """:func:`json.dumps` of :func:`finite` ``(data)``, refusing any NaN or infinity left (``allow_nan=False``)."""
    return json.dumps(finite(data), allow_nan=False, **options)
