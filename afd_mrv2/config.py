"""Typed configuration parsed from ``additional_config["afd"]``, and the one options parser.

vLLM hands plugins the ``--additional-config`` JSON as a plain dict.  Everything
afd-mrv2 reads from it is parsed here, once, into frozen dataclasses, before any
stream, thread or communication resource exists.  Bad input raises
:class:`~afd_mrv2.errors.ConfigError` with a single line that names the dotted
key and the accepted values::

    afd.multistream.depth: expected an integer in 1..8 or "auto", got 0 (int)

One mechanism serves every options section: ``afd``, ``afd.multistream``,
``afd.async_moe`` and each connector's ``connector_extra_config``.  A section is
a frozen dataclass whose fields are declared with :func:`option` (nested sections
with :func:`section`): the field holds the default, written once, and a
:class:`Check` (``FLAG``, :func:`integer`, :func:`number`, ``TEXT``,
:func:`one_of`, :func:`subset_of`, ...) holds the type and the range or choices.  :func:`parse_section` derives the accepted
keys from the fields, rejects unknown keys, runs each check and builds the
dataclass; checks that involve several keys stay with the section's own parse
function (e.g. :func:`parse_afd_config`).

Why our own parser and not pydantic v2 (decided for issue 11, see docs/config.md):
pydantic is what vLLM's own config is built on, but it is not a dependency of
afd-mrv2 (the embedded run needs torch, pluggy and packaging only) and would
become one just to parse about thirty keys.  Its errors are multi-line
``ValidationError`` reports that name the key as a location tuple; an unknown
key reads "Extra inputs are not permitted" without the accepted keys, and a
union such as ``int | "auto"`` reports one error per member.  Keeping the
one-line messages that name the dotted key and the accepted values would mean a
translation layer over pydantic's error types, no smaller than these checks.

Values are stored as tuples and frozen dataclasses so the parsed config is
hashable, like vLLM requires of ``additional_config`` (it feeds the compile-cache
hash).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, TypeVar

from afd_mrv2.errors import ConfigError
from afd_mrv2.items import ATTENTION, FFN, PHASES

ROLES = (ATTENTION, FFN)
#: The communication phases (the first and last of the work item's three).
STREAM_PHASES = (PHASES[0], PHASES[-1])
BACKENDS = ("auto", "accelerator", "host", "recording")
MAX_DEPTH = 8
AUTO = "auto"
ASYNC_MOE_SPLITS = ("request", "token")
#: Stages per batch of async-MoE ubatching, and the most any connector runs.
ASYNC_MOE_STAGES = 2

T = TypeVar("T")


# ------------------------------------------------------------------ the checks


@dataclass(frozen=True)
class Check:
    """How one option is checked: ``accepts`` says yes or no, ``convert`` builds the stored value.

    ``expected`` names the accepted values in errors ("an integer in 1..8");
    ``missing_hint`` follows "required key is missing".
    """

    expected: str
    accepts: Callable[[Any], bool]
    convert: Callable[[Any, str], Any] = lambda value, key: value
    missing_hint: str = ""

    def __call__(self, value: Any, key: str) -> Any:
        if not self.accepts(value):
            raise ConfigError(key, f"expected {self.expected}, got {_show(value)}")
        return self.convert(value, key)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(low: int, high: int | None = None, *, also: tuple[str, ...] = (), why: str = "") -> Check:
    """An integer in ``low..high`` (``high`` None: unbounded) or one of the strings ``also``;
    ``why`` follows the accepted values (e.g. why only one value is accepted)."""
    text = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"
    text = str(low) if low == high else text
    text += "".join(f' or "{a}"' for a in also) + (f" ({why})" if why else "")

    def accepts(v: Any) -> bool:
        if isinstance(v, str):
            return v in also
        return _is_int(v) and low <= v and (high is None or v <= high)

    return Check(text, accepts)


def number(low: float = 0.0, high: float | None = None, *, inclusive: bool = False) -> Check:
    """A finite number above ``low`` (or at it, with ``inclusive``) and at most ``high``; stored as float."""
    text = f"a number {'>=' if inclusive else '>'} {low:g}" + ("" if high is None else f" and <= {high:g}")

    def accepts(v: Any) -> bool:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return False
        try:
            v = float(v)
        except OverflowError:  # an integer beyond float range
            return False
        above = low <= v if inclusive else low < v
        return math.isfinite(v) and above and (high is None or v <= high)

    return Check(text, accepts, lambda v, key: float(v))


def one_of(values: tuple[str, ...]) -> Check:
    listed = ", ".join(values)
    return Check(
        f"one of {listed}", lambda v: isinstance(v, str) and v in values, missing_hint=f"; accepted values: {listed}"
    )


def subset_of(values: tuple[str, ...], *, allow_empty: bool = False) -> Check:
    """A list of distinct values from ``values``; stored as a tuple in the order of ``values``."""

    def accepts(v: Any) -> bool:
        if not isinstance(v, (list, tuple)) or (not v and not allow_empty):
            return False
        return all(isinstance(x, str) and x in values for x in v) and len(set(v)) == len(v)

    expected = f"a {'' if allow_empty else 'non-empty '}list of distinct values from {', '.join(values)}"
    return Check(expected, accepts, lambda v, key: tuple(x for x in values if x in v))


def _distinct(value: Any, key: str) -> tuple[str, ...]:
    if len(set(value)) != len(value):
        raise ConfigError(key, f"expected a list without duplicates, got {_show(value)}")
    return tuple(value)


FLAG = Check("true or false", lambda v: isinstance(v, bool))
TEXT = Check("a non-empty string", lambda v: isinstance(v, str) and bool(v))
#: A list of distinct non-empty strings, in the given order.
NAMES = Check(
    "a list of non-empty strings",
    lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) and x for x in v),
    _distinct,
)
#: A mapping with string keys of JSON values, frozen into sorted item tuples (see ``AfdConfig.extra``).
JSON = Check(
    "a mapping with string keys",
    lambda v: isinstance(v, Mapping) and all(isinstance(k, str) for k in v),
    lambda v, key: tuple(sorted((k, _freeze(x, _join_key(key, k))) for k, x in v.items())),
)
#: Any value, taken as is: for an option whose owner parses it (e.g. ``stream_evidence``).
ANYTHING = Check("any value", lambda v: True)


# ------------------------------------------------------------------ the parser

_META = "afd_mrv2.option"


def option(check: Check, default: Any = MISSING, *, key: str | None = None) -> Any:
    """Declare a field of an options dataclass: its ``check`` and its ``default``.

    No default: the key is required.  Default None: the key is optional and
    ``null`` means unset.  ``key`` names the raw key when it is not a Python
    identifier (``async``).
    """
    return field(default=default, metadata={_META: (check, key)})


def section(kind: type) -> Any:
    """Declare a nested section parsed into the options dataclass ``kind`` (missing or null: its defaults)."""
    check = Check("a mapping", lambda v: True, lambda v, key: kind() if v is None else parse_section(kind, v, key))
    return field(default_factory=kind, metadata={_META: (check, None)})


def accepted_keys(kind: type) -> dict[str, Field[Any]]:
    """Raw key -> field, for every field of the options dataclass ``kind`` declared with :func:`option`."""
    return {f.metadata[_META][1] or f.name: f for f in fields(kind) if f.init}


def parse_section(kind: type[T], raw: object, key: str, *, moved: Mapping[str, str] | None = None) -> T:
    """Parse the mapping ``raw`` (at dotted ``key``) into the options dataclass ``kind``.

    Unknown keys, wrong types and values out of range raise :class:`ConfigError`
    naming ``key.<name>``; a key listed in ``moved`` is refused with a pointer to
    its new home.  Keys left out take the dataclass's defaults.
    """
    if not isinstance(raw, Mapping):
        raise ConfigError(key, f"expected a mapping, got {_show(raw)}")
    known = accepted_keys(kind)
    for name in raw:
        if moved and name in moved:
            raise ConfigError(_join_key(key, name), f"not a connector option in afd-mrv2; use {moved[name]}")
        if name not in known:
            raise ConfigError(_join_key(key, name), f"unknown key; accepted keys: {', '.join(sorted(known))}")
    values: dict[str, Any] = {}
    for name, f in known.items():
        check: Check = f.metadata[_META][0]
        if name not in raw:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError(f"{key}.{name}", "required key is missing" + check.missing_hint)
        elif raw[name] is None and f.default is None:
            values[f.name] = None
        else:
            values[f.name] = check(raw[name], f"{key}.{name}")
    return kind(**values)


# ------------------------------------------------------------------ the afd sections


@dataclass(frozen=True)
class BufferCounts:
    """``afd.multistream.buffers``: input and output buffer counts set apart."""

    inputs: int = option(integer(1, MAX_DEPTH), key="in")
    outputs: int = option(integer(1, MAX_DEPTH), key="out")


@dataclass(frozen=True)
class MultistreamConfig:
    """The ``afd.multistream`` section: how the shared executor schedules phases.

    enabled
        False (the default) runs every phase of every work item on one stream, in
        order: the serialized fallback.  True gives recv and send their own
        streams so they overlap compute.
    depth
        The simple knob (1..8, default 2), or ``"auto"``: sets both buffer counts
        (see ``buffers``).  Work item ``k`` fills input buffer ``k % depth`` and
        output buffer ``k % depth``; an input buffer is reused once compute
        consumed it, an output buffer once send completed, so depth 2 overlaps
        all three balanced phases.  ``"auto"`` runs the first ``auto_window``
        items with 8 of each, measures their phase times, and keeps the
        (input, output) counts the analytic model
        (:mod:`afd_mrv2.pipeline.schedule_model`) puts within 5 % of unbounded
        with the fewest buffer bytes; it logs the choice once.
    buffers
        ``{"in": N, "out": M}`` (each 1..8): input and output buffer counts set
        apart, overriding ``depth``.
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
        Default deadline of :meth:`Executor.close`, in seconds (0 < s <= 3600).
    trace
        Record a span per phase (for Perfetto traces and overlap metrics).
    """

    enabled: bool = option(FLAG, False)
    depth: int | str = option(integer(1, MAX_DEPTH, also=(AUTO,)), 2)
    auto_window: int = option(integer(1, 1024), 8)
    roles: tuple[str, ...] = option(subset_of(ROLES), (FFN,))
    phases: tuple[str, ...] = option(subset_of(STREAM_PHASES), STREAM_PHASES)
    backend: str = option(one_of(BACKENDS), AUTO)
    close_timeout_s: float = option(number(0.0, 3600.0), 10.0)
    trace: bool = option(FLAG, False)
    buffers: BufferCounts | None = option(
        Check(
            'a mapping {"in": N, "out": M}',
            lambda v: isinstance(v, Mapping),
            lambda v, key: parse_section(BufferCounts, v, key),
        ),
        None,
    )

    @property
    def auto_depth(self) -> bool:
        return self.depth == AUTO and self.buffers is None

    @property
    def buffer_counts(self) -> tuple[int, int]:
        """(input, output) buffer slots to allocate: ``buffers``, else ``depth`` for
        both, or the most ``auto`` may choose."""
        if self.buffers is not None:
            return (self.buffers.inputs, self.buffers.outputs)
        depth = MAX_DEPTH if self.depth == AUTO else int(self.depth)
        return (depth, depth)

    @property
    def slots(self) -> int:
        """The larger buffer count (what ``depth`` sizes per-slot resources by)."""
        return max(self.buffer_counts)

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

    enabled: bool = option(FLAG, False)
    split: str = option(one_of(ASYNC_MOE_SPLITS), "request")
    num_stages: int = option(
        integer(ASYNC_MOE_STAGES, ASYNC_MOE_STAGES, why="async-MoE ubatching supports exactly two stages"),
        ASYNC_MOE_STAGES,
    )

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
    ``num_ffn_ranks`` must divide ``num_attention_ranks``.  ``connector_extra_config``
    is parsed by the connector (:func:`parse_section` on its own options dataclass).
    """

    connector: str = option(TEXT)
    role: str = option(one_of(ROLES))
    num_attention_ranks: int = option(integer(1, 1 << 16), 1)
    num_ffn_ranks: int = option(integer(1, 1 << 16), 1)
    host: str = option(TEXT, "127.0.0.1")
    port: int = option(integer(1, 65535), 29500)
    compute_gate_on_attention: bool = option(FLAG, False)
    async_mode: bool = option(FLAG, False, key="async")
    observers: tuple[str, ...] = option(NAMES, ())
    connector_extra_config: tuple[tuple[str, Any], ...] = option(JSON, ())
    multistream: MultistreamConfig = section(MultistreamConfig)
    async_moe: AsyncMoeConfig = section(AsyncMoeConfig)

    @property
    def extra(self) -> dict[str, Any]:
        """``connector_extra_config`` as a fresh dict (the stored form is hashable)."""
        return {k: _thaw(v) for k, v in self.connector_extra_config}


def parse_multistream(raw: object, *, key: str = "afd.multistream") -> MultistreamConfig:
    """Parse the ``multistream`` section (a mapping, or None for the defaults)."""
    return MultistreamConfig() if raw is None else parse_section(MultistreamConfig, raw, key)


def parse_afd_config(raw: object, *, key: str = "afd") -> AfdConfig:
    """Parse the ``afd`` section of ``additional_config``, then the checks that span keys."""
    config = parse_section(AfdConfig, raw, key)
    attention, ffn = config.num_attention_ranks, config.num_ffn_ranks
    if attention < ffn or attention % ffn:
        raise ConfigError(
            f"{key}.num_ffn_ranks",
            f"expected a divisor of num_attention_ranks ({attention}) that is <= it, got {ffn}",
        )
    if config.async_moe.enabled and not config.compute_gate_on_attention:
        raise ConfigError(
            f"{key}.async_moe.enabled",
            "async-MoE ubatching dispatches each stage's routing from the attention side; "
            f"set {key}.compute_gate_on_attention to true",
        )
    return config


# ------------------------------------------------------------------ helpers


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
