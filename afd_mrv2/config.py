"""Typed configuration parsed from ``additional_config["afd"]``.

vLLM hands plugins the ``--additional-config`` JSON as a plain dict.  Everything
afd-mrv2 reads from it is parsed here, once, into frozen dataclasses, before any
stream, thread or communication resource exists.  Bad input raises
:class:`~afd_mrv2.errors.ConfigError` with a single line that names the dotted
key and the accepted values::

    afd.multistream.depth: expected an integer in 1..8, got 0

Values are stored as tuples and frozen dataclasses so the parsed config is
hashable, like vLLM requires of ``additional_config`` (it feeds the compile-cache
hash).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from afd_mrv2.errors import ConfigError

ROLES = ("attention", "ffn")
STREAM_PHASES = ("recv", "send")
BACKENDS = ("auto", "accelerator", "host", "recording")
MAX_DEPTH = 8
AUTO = "auto"
ASYNC_MOE_SPLITS = ("request", "token")
ASYNC_MOE_STAGES = 2


@dataclass(frozen=True)
class MultistreamConfig:
    """The ``afd.multistream`` section: how the shared executor schedules phases.

    enabled
        False (the default) runs every phase of every work item on one stream, in
        order: the serialized fallback.  True gives recv and send their own
        streams so they overlap compute.
    depth
        In-flight work slots (1..8), or ``"auto"``.  Slot ``k % depth`` carries
        work item ``k``; a slot is reused only after its previous send completed,
        so three balanced phases need depth 3 to all overlap.  ``"auto"`` runs the
        first ``auto_window`` items at depth 8, measures their phase times, picks
        the smallest depth the analytic model (:mod:`afd_mrv2.pipeline.schedule_model`)
        puts within 5 % of unbounded depth, logs the choice once, and keeps it.
    auto_window
        Work items measured before ``depth: "auto"`` decides (1..1024, default 8).
    roles
        Which AFD roles run multistream when enabled (``attention``, ``ffn``).
    phases
        Which communication phases get a stream of their own (``recv``, ``send``);
        a phase not listed runs on the compute stream.
    backend
        Stream backend: ``accelerator`` (torch.Stream/torch.Event on CUDA or NPU),
        ``host`` (a worker thread per stream), ``recording`` (deterministic op log,
        for tests) or ``auto`` (accelerator when ``torch.accelerator`` reports one,
        else host).
    close_timeout_s
        Default deadline of :meth:`Executor.close`, in seconds.
    trace
        Record a span per phase (for Perfetto traces and overlap metrics).
    """

    enabled: bool = False
    depth: int | str = 2
    auto_window: int = 8
    roles: tuple[str, ...] = ("ffn",)
    phases: tuple[str, ...] = STREAM_PHASES
    backend: str = "auto"
    close_timeout_s: float = 10.0
    trace: bool = False
    buffers: tuple[int, int] | None = None

    @property
    def auto_depth(self) -> bool:
        return self.depth == AUTO and self.buffers is None

    @property
    def buffer_counts(self) -> tuple[int, int]:
        """(input slots, output slots) to allocate: ``buffers`` if given, else
        ``depth`` for both, or the most ``auto`` may choose."""
        if self.buffers is not None:
            return self.buffers
        depth = MAX_DEPTH if self.depth == AUTO else int(self.depth)
        return (depth, depth)

    def active_for(self, role: str) -> bool:
        """True when ``role`` runs the pipelined (multistream) schedule."""
        return self.enabled and role in self.roles


@dataclass(frozen=True)
class AsyncMoeConfig:
    """The ``afd.async_moe`` section: AFD-managed two-stage MoE ubatching (CAMAsync).

    enabled
        False (the default) runs each batch as one stage.  True cuts every batch
        into two stages with :func:`afd_mrv2.ubatch.plan_stages` so one stage's
        MoE overlaps the other's attention.  Needs ``compute_gate_on_attention``
        (each stage dispatches its own routing).
    split
        ``request`` (cut at a request boundary) or ``token`` (cut the flattened
        tokens in half; a request may continue in stage 2 as a chunked prefill).
    num_stages
        Exactly 2: more stages are refused here, at configuration time.
    """

    enabled: bool = False
    split: str = "request"
    num_stages: int = ASYNC_MOE_STAGES

    @property
    def stages(self) -> int:
        """Stages per batch: ``num_stages`` when enabled, else 1."""
        return self.num_stages if self.enabled else 1


@dataclass(frozen=True)
class AfdConfig:
    """The whole ``afd`` section of ``additional_config``.

    The keys follow the upstream AFD plugin (``connector``, ``role``,
    ``num_attention_ranks``, ``num_ffn_ranks``, ``host``, ``port``,
    ``compute_gate_on_attention``, ``async``, ``connector_extra_config``) plus
    afd-mrv2's ``multistream`` and ``async_moe`` sections and ``observers`` (names of
    observer plugins to enable).  ``async`` is stored as ``async_mode`` (a Python keyword).
    """

    connector: str
    role: str
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    host: str = "127.0.0.1"
    port: int = 29500
    compute_gate_on_attention: bool = False
    async_mode: bool = False
    observers: tuple[str, ...] = ()
    connector_extra_config: tuple[tuple[str, Any], ...] = ()
    multistream: MultistreamConfig = field(default_factory=MultistreamConfig)
    async_moe: AsyncMoeConfig = field(default_factory=AsyncMoeConfig)

    @property
    def extra(self) -> dict[str, Any]:
        """``connector_extra_config`` as a fresh dict (the stored form is hashable)."""
        return {k: _thaw(v) for k, v in self.connector_extra_config}


# --------------------------------------------------------------------------- parsing


def parse_multistream(raw: object, *, key: str = "afd.multistream") -> MultistreamConfig:
    """Parse the ``multistream`` section (a mapping, or None for the defaults)."""
    if raw is None:
        return MultistreamConfig()
    section = Section(raw, key, _MULTISTREAM_KEYS)
    return MultistreamConfig(
        enabled=section.boolean("enabled", False),
        depth=section.depth("depth", 2),
        auto_window=section.integer("auto_window", 8, low=1, high=1024),
        roles=section.choices("roles", ("ffn",), ROLES, allow_empty=False),
        phases=section.choices("phases", STREAM_PHASES, STREAM_PHASES, allow_empty=False),
        backend=section.choice("backend", "auto", BACKENDS),
        close_timeout_s=section.number("close_timeout_s", 10.0, low=0.0, high=3600.0),
        trace=section.boolean("trace", False),
        buffers=_buffers(section.get("buffers", None), f"{key}.buffers"),
    )


def _buffers(raw: object, key: str) -> tuple[int, int] | None:
    if raw is None:
        return None
    section = Section(raw, key, ("in", "out"))
    if "in" not in section.raw or "out" not in section.raw:
        raise ConfigError(key, 'expected both "in" and "out", e.g. {"in": 2, "out": 2}')
    return (section.integer("in", 0, low=1, high=MAX_DEPTH), section.integer("out", 0, low=1, high=MAX_DEPTH))


def parse_async_moe(raw: object, *, key: str = "afd.async_moe") -> AsyncMoeConfig:
    """Parse the ``async_moe`` section (a mapping, or None for the defaults)."""
    if raw is None:
        return AsyncMoeConfig()
    section = Section(raw, key, _ASYNC_MOE_KEYS)
    stages = section.get("num_stages", ASYNC_MOE_STAGES)
    if isinstance(stages, bool) or not isinstance(stages, int) or stages != ASYNC_MOE_STAGES:
        raise ConfigError(
            f"{key}.num_stages",
            f"expected {ASYNC_MOE_STAGES} (async-MoE ubatching supports exactly two stages), got {_show(stages)}",
        )
    return AsyncMoeConfig(
        enabled=section.boolean("enabled", False),
        split=section.choice("split", "request", ASYNC_MOE_SPLITS),
        num_stages=stages,
    )


def parse_afd_config(raw: object, *, key: str = "afd") -> AfdConfig:
    """Parse the ``afd`` section of ``additional_config``."""
    section = Section(raw, key, _AFD_KEYS)
    attention = section.integer("num_attention_ranks", 1, low=1, high=1 << 16)
    ffn = section.integer("num_ffn_ranks", 1, low=1, high=1 << 16)
    if attention < ffn or attention % ffn:
        raise ConfigError(
            f"{key}.num_ffn_ranks",
            f"expected a divisor of num_attention_ranks ({attention}) that is <= it, got {ffn}",
        )
    extra = section.get("connector_extra_config", {})
    if not isinstance(extra, Mapping) or not all(isinstance(k, str) for k in extra):
        raise ConfigError(f"{key}.connector_extra_config", f"expected a mapping with string keys, got {_show(extra)}")
    async_moe = parse_async_moe(section.get("async_moe", None), key=f"{key}.async_moe")
    gate_on_attention = section.boolean("compute_gate_on_attention", False)
    if async_moe.enabled and not gate_on_attention:
        raise ConfigError(
            f"{key}.async_moe.enabled",
            "async-MoE ubatching dispatches each stage's routing from the attention side; "
            f"set {key}.compute_gate_on_attention to true",
        )
    return AfdConfig(
        connector=section.string("connector", required=True),
        role=section.choice("role", None, ROLES),
        num_attention_ranks=attention,
        num_ffn_ranks=ffn,
        host=section.string("host", "127.0.0.1"),
        port=section.integer("port", 29500, low=1, high=65535),
        compute_gate_on_attention=gate_on_attention,
        async_mode=section.boolean("async", False),
        observers=section.names("observers"),
        connector_extra_config=tuple(
            sorted((k, _freeze(v, _join_key(f"{key}.connector_extra_config", k))) for k, v in extra.items())
        ),
        multistream=parse_multistream(section.get("multistream", None), key=f"{key}.multistream"),
        async_moe=async_moe,
    )


_ASYNC_MOE_KEYS = ("enabled", "split", "num_stages")
_MULTISTREAM_KEYS = ("enabled", "depth", "auto_window", "roles", "phases", "backend", "close_timeout_s", "trace", "buffers")
_AFD_KEYS = (
    "connector",
    "role",
    "num_attention_ranks",
    "num_ffn_ranks",
    "host",
    "port",
    "compute_gate_on_attention",
    "async",
    "observers",
    "connector_extra_config",
    "multistream",
    "async_moe",
)


class Section:
    """One mapping being parsed: rejects unknown keys, reads typed values.

    Public so that connectors parse their ``connector_extra_config`` with the same
    one-line errors as the ``afd`` section itself.
    """

    def __init__(self, raw: object, key: str, accepted: tuple[str, ...]) -> None:
        if not isinstance(raw, Mapping):
            raise ConfigError(key, f"expected a mapping, got {_show(raw)}")
        for name in raw:
            if name not in accepted:
                raise ConfigError(_join_key(key, name), f"unknown key; accepted keys: {', '.join(sorted(accepted))}")
        self.raw = raw
        self.key = key

    def get(self, name: str, default: Any) -> Any:
        return self.raw.get(name, default)

    def _fail(self, name: str, expected: str) -> ConfigError:
        return ConfigError(f"{self.key}.{name}", f"expected {expected}, got {_show(self.raw[name])}")

    def boolean(self, name: str, default: bool) -> bool:
        value = self.raw.get(name, default)
        if not isinstance(value, bool):
            raise self._fail(name, "true or false")
        return value

    def integer(self, name: str, default: int, *, low: int, high: int) -> int:
        value = self.raw.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self._fail(name, f"an integer in {low}..{high}")
        return value

    def depth(self, name: str, default: int) -> int | str:
        value = self.raw.get(name, default)
        if value == AUTO:
            return AUTO
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DEPTH:
            raise self._fail(name, f'an integer in 1..{MAX_DEPTH} or "{AUTO}"')
        return value

    def number(self, name: str, default: float, *, low: float, high: float) -> float:
        value = self.raw.get(name, default)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or not low < value <= high:
            raise self._fail(name, f"a number > {low:g} and <= {high:g}")
        return float(value)

    def string(self, name: str, default: str | None = None, *, required: bool = False) -> str:
        if required and name not in self.raw:
            raise ConfigError(f"{self.key}.{name}", "required key is missing")
        value = self.raw.get(name, default)
        if not isinstance(value, str) or not value:
            raise self._fail(name, "a non-empty string")
        return value

    def choice(self, name: str, default: str | None, accepted: tuple[str, ...]) -> str:
        if default is None and name not in self.raw:
            raise ConfigError(f"{self.key}.{name}", f"required key is missing; accepted values: {', '.join(accepted)}")
        value = self.raw.get(name, default)
        if value not in accepted or not isinstance(value, str):
            raise self._fail(name, f"one of {', '.join(accepted)}")
        return value

    def choices(
        self, name: str, default: tuple[str, ...], accepted: tuple[str, ...], *, allow_empty: bool
    ) -> tuple[str, ...]:
        value = self.raw.get(name, default)
        expected = f"a {'' if allow_empty else 'non-empty '}list of distinct values from {', '.join(accepted)}"
        if not isinstance(value, (list, tuple)) or (not value and not allow_empty):
            raise self._fail(name, expected)
        if any(not isinstance(v, str) or v not in accepted for v in value) or len(set(value)) != len(value):
            raise self._fail(name, expected)
        return tuple(v for v in accepted if v in value)

    def names(self, name: str) -> tuple[str, ...]:
        value = self.raw.get(name, [])
        if not isinstance(value, (list, tuple)) or any(not isinstance(v, str) or not v for v in value):
            raise self._fail(name, "a list of non-empty strings")
        if len(set(value)) != len(value):
            raise self._fail(name, "a list without duplicates")
        return tuple(value)


def _join_key(base: str, name: object) -> str:
    """``base.name`` for plain names; ``base[<repr>]`` for anything that would not read well."""
    if isinstance(name, str) and name and name.isprintable() and " " not in name and "." not in name:
        return f"{base}.{name}"
    return f"{base}[{name!r}]"


def _show(value: object) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _freeze(value: Any, key: str) -> Any:
    """JSON-like value -> hashable equivalent (dicts become sorted item tuples)."""
    if isinstance(value, Mapping):
        return ("__map__", tuple(sorted((str(k), _freeze(v, _join_key(key, k))) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return ("__seq__", tuple(_freeze(v, key) for v in value))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ConfigError(key, f"expected a JSON value (mapping, list, string, number, bool, null), got {_show(value)}")


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "__map__":
        return {k: _thaw(v) for k, v in value[1]}
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "__seq__":
        return [_thaw(v) for v in value[1]]
    return value
