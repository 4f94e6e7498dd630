"""The public hook API: everything a connector or observer may use, and its version.

A plugin written against this module keeps working across afd-mrv2 releases that
serve its ``hook_api_version`` (declare it as a class attribute of the factory the
entry point names; none declared is API 0).  Anything not listed here is internal
and may change without notice.  CHANGELOG.md records every change to these names
and to the user-facing ones (config keys, report fields, metric names, CLI flags);
a renamed or removed member keeps working for one more API version with a
``DeprecationWarning`` that names its replacement.

* markers: :data:`hookimpl` (implementations), :data:`hookspec`;
* the five hook specifications (:mod:`afd_mrv2.hookspecs`, the manual):
  ``create_streams``, ``on_recv``, ``on_compute``, ``on_send``, ``on_cleanup``,
  and the owner's compute function's protocol :class:`ComputeFn`;
* what the hooks receive: :class:`Work`, its :class:`BufferSlot` s, the item
  identity :class:`WorkItem`; and what a factory receives, :class:`ConnectorContext`;
* the streams a hook is given: :class:`Stream`, :class:`Event`, :class:`DeviceBackend`;
* the errors a hook may raise or see: :class:`AfdError`, :class:`PluginError`,
  :class:`PipelineError`, :class:`PipelineAborted`;
* versions: :data:`HOOK_API_VERSION`, :data:`OLDEST_SERVED_HOOK_API`;
* and the module :mod:`afd_mrv2.options`, whole: the parser a connector uses for its
  ``connector_extra_config`` (docs/config.md).
"""

from __future__ import annotations

from afd_mrv2.devices.base import DeviceBackend, Event, Stream
from afd_mrv2.errors import AfdError, PipelineAborted, PipelineError, PluginError
from afd_mrv2.hookspecs import (
    HOOK_API_VERSION,
    OLDEST_SERVED_HOOK_API,
    ComputeFn,
    hookimpl,
    hookspec,
)
from afd_mrv2.items import WorkItem
from afd_mrv2.plugins import HOOK_NAMES, ConnectorContext
from afd_mrv2.work import BufferSlot, Work

#: The hook specifications, in lifecycle order (set-up, per item, tear-down).
HOOKS = HOOK_NAMES

__all__ = [
    "HOOKS",
    "HOOK_API_VERSION",
    "OLDEST_SERVED_HOOK_API",
    "AfdError",
    "BufferSlot",
    "ComputeFn",
    "ConnectorContext",
    "DeviceBackend",
    "Event",
    "PipelineAborted",
    "PipelineError",
    "PluginError",
    "Stream",
    "Work",
    "WorkItem",
    "hookimpl",
    "hookspec",
]
