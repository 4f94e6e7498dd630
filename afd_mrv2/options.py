"""The one options mechanism: declare a section as a frozen dataclass, parse it with one parser.

:func:`option`, :func:`section`, :class:`Check` (``FLAG``, :func:`integer`, :func:`one_of`, ...),
:func:`parse_section`; why not pydantic: docs/config.md.

See docs/internals/hooks-api.md, "afd_mrv2.options".
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, TypeVar

from afd_mrv2.errors import ConfigError

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


def json_object(text: str, what: str) -> dict[str, Any]:
    """``text`` parsed as a JSON object (a command-line ``afd`` section, say); one-line errors naming ``what``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(what, f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if not isinstance(value, dict):
        raise ConfigError(what, f"expected a JSON object, got {type(value).__name__}")
    return value
