"""The evidence document: one versioned JSON format for everything run on the hardware.

Schema ``afd-mrv2/evidence/v1`` (:class:`Evidence`); documented for hardware owners in
docs/ascend-deployment.md, "The evidence document".

See docs/internals/cam-connectors.md, "afd_mrv2.hooks.cam.evidence".
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from afd_mrv2.errors import ConfigError

SCHEMA = "afd-mrv2/evidence/v1"
PASS, FAIL, SKIPPED = "pass", "fail", "skipped"
STATUSES = (PASS, FAIL, SKIPPED)
TOP_LEVEL = ("schema", "producer", "created", "environment", "versions", "checks", "summary")
CHECK_FIELDS = ("name", "status", "measured", "detail")
OPERATOR, COMPARISON = "operator:", "comparison:"


@dataclass(frozen=True)
class Check:
    """One row: what was checked, how it came out, what was measured and why."""

    name: str
    status: str
    measured: Any = None
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "measured": self.measured, "detail": self.detail}


@dataclass(frozen=True)
class Report:
    """A whole evidence document (see docs/internals/cam-connectors.md)."""

    producer: str
    checks: tuple[Check, ...]
    versions: Mapping[str, str] = field(default_factory=dict)
    environment: Mapping[str, str] = field(default_factory=dict)
    created: str = ""

    @property
    def summary(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in STATUSES}

    @property
    def failed(self) -> bool:
        return any(c.status == FAIL for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        doc = {
            "schema": SCHEMA,
            "producer": self.producer,
            "created": self.created or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "environment": dict(self.environment),
            "versions": dict(self.versions),
            "checks": [c.to_json() for c in self.checks],
            "summary": self.summary,
        }
        problems = validate(doc)
        if problems:  # a producer's bug: never write a document a reader would refuse
            raise ValueError(f"evidence document does not match {SCHEMA}: {problems[0]}")
        return doc

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    @classmethod
    def from_json(cls, raw: object, *, key: str = "evidence") -> Report:
        problems = validate(raw)
        if problems:
            raise ConfigError(key, f"not an afd-mrv2 evidence document ({SCHEMA}): {problems[0]}")
        assert isinstance(raw, Mapping)
        checks = tuple(Check(c["name"], c["status"], c["measured"], c["detail"]) for c in raw["checks"])
        return cls(raw["producer"], checks, dict(raw["versions"]), dict(raw["environment"]), raw["created"])

    @classmethod
    def load(cls, path: str | Path, *, key: str = "evidence") -> Report:
        return cls.from_json(read_json(path, key), key=key)


def read_json(path: str | Path, key: str) -> object:
    """The JSON in ``path``; a :class:`ConfigError` naming ``key`` when it cannot be read."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(key, f"cannot read evidence file {str(path)!r}: {exc}") from None


def _string_map(value: object) -> bool:
    return isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _top_level_problems(doc: Mapping[str, object]) -> list[str]:
    """The document's own keys: none missing, none unknown, each of its type."""
    problems = [f"missing key {k!r}" for k in TOP_LEVEL if k not in doc]
    problems += [f"unknown key {k!r}" for k in doc if k not in TOP_LEVEL]
    for k in ("producer", "created"):
        if k in doc and (not isinstance(doc[k], str) or not doc[k]):
            problems.append(f"{k}: expected a non-empty string")
    for k in ("environment", "versions"):
        if k in doc and not _string_map(doc[k]):
            problems.append(f"{k}: expected an object of strings")
    return problems


def _check_row_problems(i: int, c: Mapping[str, object], seen: set[str]) -> list[str]:
    """One check row with exactly :data:`CHECK_FIELDS`; adds its name to ``seen``."""
    problems = []
    name = c["name"]
    if not isinstance(name, str) or not name or name in seen:
        problems.append(f"checks[{i}].name: expected a unique non-empty string, got {name!r}")
    seen.add(str(name))
    if c["status"] not in STATUSES:
        problems.append(f"checks[{i}].status: expected one of {', '.join(STATUSES)}, got {c['status']!r}")
    if not isinstance(c["detail"], str):
        problems.append(f"checks[{i}].detail: expected a string")
    elif c["status"] in (FAIL, SKIPPED) and not c["detail"]:
        problems.append(f"checks[{i}] ({name}): a {c['status']} row must say why (detail)")
    try:
        json.dumps(c["measured"], allow_nan=False)
    except (TypeError, ValueError):
        problems.append(f"checks[{i}].measured: expected a JSON value (no NaN or infinity)")
    return problems


def validate(doc: object) -> list[str]:
    """Every way ``doc`` departs from the schema, one line each (empty: it matches)."""
    if not isinstance(doc, Mapping):
        return [f"expected a JSON object, got {type(doc).__name__}"]
    if doc.get("schema") != SCHEMA:
        return [f"schema: expected {SCHEMA!r}, got {doc.get('schema')!r}"]
    problems = _top_level_problems(doc)
    checks = doc.get("checks")
    if not isinstance(checks, list):
        return [*problems, "checks: expected a list"]
    seen: set[str] = set()
    for i, c in enumerate(checks):
        if not isinstance(c, Mapping) or sorted(c) != sorted(CHECK_FIELDS):
            problems.append(f"checks[{i}]: expected exactly the keys {', '.join(CHECK_FIELDS)}")
            continue
        problems += _check_row_problems(i, c, seen)
    expected = {s: sum(isinstance(c, Mapping) and c.get("status") == s for c in checks) for s in STATUSES}
    if "summary" in doc and doc["summary"] != expected:
        problems.append(f"summary: expected {expected} (the checks' statuses), got {doc['summary']}")
    return problems


def environment_block(**more: str) -> dict[str, str]:
    """Where a document was produced: host, platform, Python, plus what the producer adds."""
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        **more,
    }


def distribution_versions(names: Iterable[str]) -> dict[str, str]:
    """Installed versions of the named distributions (the absent ones left out)."""
    from importlib import metadata

    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


# --- the CAM operator rows a connector reads ---------------------------------------------------------------


class StreamBehaviour(str, Enum):
    """How an operator relates to the caller's current stream."""

    CURRENT = "current"  # enqueues on the caller's current stream: stream order covers it
    FOREIGN = "foreign"  # runs elsewhere (its "home" stream): needs the narrow fence
    UNVERIFIED = "unverified"  # nobody established it: serialized only


HOMES = ("default",)  # foreign homes an accelerator fence can name: the device default stream


@dataclass(frozen=True)
class OpEvidence:
    """What the probe established about one operator (``namespace.name``)."""

    qualname: str
    present: bool
    stream: StreamBehaviour = StreamBehaviour.UNVERIFIED
    home: str | None = None
    concurrent_in_flight_safe: bool | None = None
    detail: str = ""

    def check(self) -> Check:
        """This operator as an evidence row: pass when present, its stream behaviour established
        and two in-flight transfers not found unsafe; skipped when not registered."""
        measured = {
            "present": self.present,
            "stream": self.stream.value,
            "home": self.home,
            "concurrent_in_flight_safe": self.concurrent_in_flight_safe,
        }
        if not self.present:
            status, detail = SKIPPED, self.detail or "skipped: not registered with torch (library not imported)"
        elif self.stream is StreamBehaviour.UNVERIFIED or self.concurrent_in_flight_safe is False:
            status, detail = FAIL, self.detail or "stream behaviour not established, or in-flight transfers unsafe"
        else:
            status, detail = PASS, self.detail
        return Check(OPERATOR + self.qualname, status, measured, detail)


def _comparison(name: str, measured: Any) -> Check:
    if isinstance(measured, Mapping) and "skipped" in measured:
        return Check(COMPARISON + name, SKIPPED, dict(measured), f"skipped: {measured['skipped']}")
    if isinstance(measured, Mapping) and measured.get("equal") is True:
        return Check(COMPARISON + name, PASS, dict(measured), "serialized and multistream outputs are equal")
    return Check(COMPARISON + name, FAIL, measured, "serialized and multistream outputs differ (or a mode failed)")


@dataclass(frozen=True)
class Evidence:
    """The probe's document seen by a connector: ``environment`` is the ``versions`` block the
    operator rows are tied to; ``checks`` are the rows that are neither operators nor comparisons."""

    environment: Mapping[str, str]
    operators: Mapping[str, OpEvidence]
    comparisons: Mapping[str, Any] = field(default_factory=dict)
    checks: tuple[Check, ...] = ()
    producer: str = "afd-mrv2 probe npu"
    context: Mapping[str, str] = field(default_factory=dict)  # the document's environment block

    def get(self, qualname: str) -> OpEvidence | None:
        return self.operators.get(qualname)

    def applies_to(self, environment: Mapping[str, str]) -> bool:
        """True when every version this evidence recorded matches ``environment``."""
        return all(environment.get(k) == v for k, v in self.environment.items())

    def report(self) -> Report:
        rows = [op.check() for op in self.operators.values()]
        rows += [_comparison(name, measured) for name, measured in self.comparisons.items()]
        return Report(self.producer, (*rows, *self.checks), dict(self.environment), dict(self.context))

    def to_json(self) -> dict[str, Any]:
        return self.report().to_json()

    def write(self, path: str | Path) -> Path:
        return self.report().write(path)

    @classmethod
    def from_json(cls, raw: object, *, key: str = "stream_evidence") -> Evidence:
        report = Report.from_json(raw, key=key)
        ops: dict[str, OpEvidence] = {}
        comparisons: dict[str, Any] = {}
        rest: list[Check] = []
        for row in report.checks:
            if row.name.startswith(OPERATOR):
                qualname = row.name[len(OPERATOR) :]
                ops[qualname] = _operator(qualname, row, key)
            elif row.name.startswith(COMPARISON):
                comparisons[row.name[len(COMPARISON) :]] = row.measured
            else:
                rest.append(row)
        return cls(report.versions, ops, comparisons, tuple(rest), report.producer, report.environment)

    @classmethod
    def load(cls, path: str | Path, *, key: str = "stream_evidence") -> Evidence:
        return cls.from_json(read_json(path, key), key=key)


def _operator(qualname: str, row: Check, key: str) -> OpEvidence:
    where = f"{key}.checks[{OPERATOR}{qualname}].measured"
    m = row.measured
    if not isinstance(m, Mapping):
        raise ConfigError(where, "expected an object with present, stream, home, concurrent_in_flight_safe")
    try:
        stream = StreamBehaviour(m.get("stream", "unverified"))
    except ValueError:
        raise ConfigError(f"{where}.stream", f"expected one of {', '.join(b.value for b in StreamBehaviour)}") from None
    home = m.get("home")
    if stream is StreamBehaviour.FOREIGN and home not in HOMES:
        raise ConfigError(
            f"{where}.home", f"a foreign operator needs a home the fence can name ({', '.join(HOMES)}), got {home!r}"
        )
    safe = m.get("concurrent_in_flight_safe")
    return OpEvidence(qualname, bool(m.get("present", False)), stream, home, safe, row.detail)
