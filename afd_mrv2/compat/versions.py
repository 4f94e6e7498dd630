"""Version parsing for the runtime-pair table: PEP 440 for Python packages, CANN's own scheme.

Python distributions (vLLM, vLLM-Ascend, torch, torch_npu) use PEP 440 and are
compared with :mod:`packaging`; a local label such as ``2.14.0+cu128`` matches
``==2.14.0``.  CANN versions are not PEP 440 (``8.3.RC2``, ``9.0.0``): a release
candidate ``X.Y.RCn`` sorts before the final ``X.Y.0``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import total_ordering

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

_CANN = re.compile(r"^(\d+)\.(\d+)\.(?:(\d+)|RC(\d+))(?:\.(?:alpha|beta)?\d+)?$", re.IGNORECASE)


def pep440(text: str) -> Version | None:
    """``text`` as a PEP 440 version, or None when it is not one."""
    try:
        return Version(text)
    except InvalidVersion:
        return None


def spec_matches(spec: str, version: str | None) -> bool:
    """True when ``version`` satisfies the PEP 440 specifier ``spec`` (pre-releases included)."""
    if version is None:
        return False
    parsed = pep440(version)
    if parsed is None:
        return False
    try:
        return SpecifierSet(spec, prereleases=True).contains(parsed)
    except InvalidSpecifier as exc:  # a bad table entry is a bug, not user input
        raise ValueError(f"invalid version specifier in the runtime-pair table: {spec!r}") from exc


@total_ordering
@dataclass(frozen=True)
class CannVersion:
    """A CANN version: ``9.0.0``, ``8.5.1``, ``8.3.RC2``."""

    text: str
    key: tuple[int, int, int, int]

    @classmethod
    def parse(cls, text: str) -> CannVersion | None:
        match = _CANN.match(text.strip())
        if match is None:
            return None
        major, minor, patch, rc = match.groups()
        key = (int(major), int(minor), -1, int(rc)) if rc is not None else (int(major), int(minor), int(patch), 0)
        return cls(text.strip(), key)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, CannVersion):
            return NotImplemented
        return self.key < other.key

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class CannRange:
    """An inclusive-low, exclusive-high CANN range; ``high`` None means unbounded."""

    low: str
    high: str | None = None

    def contains(self, version: str | None) -> bool:
        parsed = CannVersion.parse(version) if version else None
        if parsed is None:
            return False
        low = CannVersion.parse(self.low)
        high = CannVersion.parse(self.high) if self.high else None
        if low is None or (self.high and high is None):
            raise ValueError(f"invalid CANN range in the runtime-pair table: {self}")
        return low <= parsed and (high is None or parsed < high)

    def __str__(self) -> str:
        return f">={self.low}" + (f",<{self.high}" if self.high else "")
