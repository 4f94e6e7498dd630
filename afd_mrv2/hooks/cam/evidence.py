"""The probe's evidence file: what is known about each operator, and how it is known.

A connector cannot find out at start-up, on its own, whether a collective
operator enqueues on the caller's current stream: that takes a peer and a
controlled experiment.  ``afd-mrv2 probe npu`` runs the experiment on the
hardware and writes this file; a connector given the file
(``connector_extra_config.stream_evidence``) trusts it only when it was written
for the same software stack (:meth:`Evidence.applies_to`).

Schema (``afd-mrv2/cam-probe/v1``)::

    {"schema": "afd-mrv2/cam-probe/v1",
     "environment": {"torch": "2.10.0", "torch_npu": "...", "umdk_cam_op_lib": "..."},
     "operators": {"umdk_cam_op_lib.async_dispatch_recv":
                      {"present": true, "stream": "current", "home": null,
                       "concurrent_in_flight_safe": true, "detail": "..."}},
     "comparisons": {"camasync": {"max_abs_diff": 0.0, "equal": true}}}
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from afd_mrv2.errors import ConfigError

SCHEMA = "afd-mrv2/cam-probe/v1"


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


@dataclass(frozen=True)
class Evidence:
    environment: Mapping[str, str]
    operators: Mapping[str, OpEvidence]
    comparisons: Mapping[str, Any] = field(default_factory=dict)
    schema: str = SCHEMA

    def get(self, qualname: str) -> OpEvidence | None:
        return self.operators.get(qualname)

    def applies_to(self, environment: Mapping[str, str]) -> bool:
        """True when every version this evidence recorded matches ``environment``."""
        return all(environment.get(k) == v for k, v in self.environment.items())

    def to_json(self) -> dict[str, Any]:
        ops = {
            name: {k: (v.value if isinstance(v, Enum) else v) for k, v in asdict(op).items() if k != "qualname"}
            for name, op in self.operators.items()
        }
        return {
            "schema": self.schema,
            "environment": dict(self.environment),
            "operators": ops,
            "comparisons": dict(self.comparisons),
        }

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def from_json(cls, raw: object, *, key: str = "stream_evidence") -> Evidence:
        if not isinstance(raw, Mapping) or raw.get("schema") != SCHEMA:
            raise ConfigError(
                key, f"expected an evidence document with schema {SCHEMA!r} (written by afd-mrv2 probe npu)"
            )
        ops: dict[str, OpEvidence] = {}
        for name, entry in dict(raw.get("operators", {})).items():
            try:
                stream = StreamBehaviour(entry.get("stream", "unverified"))
            except ValueError:
                raise ConfigError(
                    f"{key}.operators.{name}.stream", f"expected one of {', '.join(b.value for b in StreamBehaviour)}"
                ) from None
            home = entry.get("home")
            if stream is StreamBehaviour.FOREIGN and home not in HOMES:
                raise ConfigError(
                    f"{key}.operators.{name}.home",
                    f"a foreign operator needs a home the fence can name ({', '.join(HOMES)}), got {home!r}",
                )
            ops[name] = OpEvidence(
                name,
                bool(entry.get("present", False)),
                stream,
                home,
                entry.get("concurrent_in_flight_safe"),
                str(entry.get("detail", "")),
            )
        return cls(dict(raw.get("environment", {})), ops, dict(raw.get("comparisons", {})))

    @classmethod
    def load(cls, path: str | Path, *, key: str = "stream_evidence") -> Evidence:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(key, f"cannot read evidence file {str(path)!r}: {exc}") from None
        return cls.from_json(raw, key=key)
