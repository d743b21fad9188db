"""Prometheus text format (0.0.4) samples, as the load generator's parsers read them (stages.py: Triton's stage
metrics; text_wait.py and gateway_load.py: the gateway's)."""

from __future__ import annotations

import re
from collections.abc import Iterator

_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str, prefix: str = "") -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample whose name starts with `prefix`; comments and blank lines skipped."""
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is not None and m["name"].startswith(prefix):
            yield m["name"], dict(_LABEL.findall(m["labels"] or "")), float(m["value"])
