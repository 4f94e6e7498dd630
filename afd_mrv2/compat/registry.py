"""The one write afd-mrv2 makes to vLLM's out-of-tree layer registry: :func:`replace_oot_layer`.

vLLM's ``register_oot`` asserts on a name registered twice and has no replace API (RFC 0005 §6
proposes one); a platform adapter replaces the platform's own entry with a subclass of it.
The caller passes vLLM's ``op_registry_oot``: this package imports no runtime.

See docs/internals/vllm-roles.md, "afd_mrv2.compat.registry".
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping

log = logging.getLogger(__name__)


class RegistryRefused(RuntimeError):
    """The registry entry is not what the replacement was built over, or the replacement does not extend it."""


def _name(cls: object) -> str:
    if isinstance(cls, type):
        return f"{cls.__module__}.{cls.__qualname__}"
    return repr(cls)


def replace_oot_layer(name: str, expected: type, replacement: type, *, registry: MutableMapping[str, type]) -> None:
    """Replace ``registry[name]``, which must be ``expected``, by ``replacement``, a proper subclass of it.

    Refuses (:class:`RegistryRefused`, naming what it found) when the entry is missing or is another
    class (someone else replaced it, or the platform registered a class this adapter was not built
    for), and when ``replacement`` does not subclass ``expected``.  Nothing is written then.
    """
    current = registry.get(name)
    if current is not expected:
        found = "nothing" if current is None else _name(current)
        raise RegistryRefused(
            f"out-of-tree layer {name!r}: expected {_name(expected)} (the platform's registration), found {found}"
        )
    if not isinstance(replacement, type) or replacement is expected or not issubclass(replacement, expected):
        raise RegistryRefused(
            f"out-of-tree layer {name!r}: {_name(replacement)} does not extend {_name(expected)}; "
            "a replacement must keep the platform's layer as its base"
        )
    registry[name] = replacement
    log.info("afd-mrv2: out-of-tree layer %r: %s now built as %s", name, _name(expected), _name(replacement))
