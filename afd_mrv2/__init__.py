"""afd-mrv2: one shared multi-stream pipeline for Attention-FFN Disaggregation on vLLM MRV2.

Public surface:

* :data:`hookimpl` / :data:`hookspec`: pluggy markers for connectors and observers
  (the hook specs in :mod:`afd_mrv2.hookspecs` are the extension manual);
* :mod:`afd_mrv2.pipeline`: the executor, work items and traces;
* :mod:`afd_mrv2.devices`: stream/event backends;
* :mod:`afd_mrv2.config`: the typed ``additional_config["afd"]`` section.
"""

from __future__ import annotations

from afd_mrv2.hookspecs import hookimpl, hookspec

__all__ = ["__version__", "hookimpl", "hookspec"]

try:
    from importlib.metadata import version as _version

    __version__ = _version("afd-mrv2")
except Exception:  # noqa: BLE001 - running from a source tree without metadata
    __version__ = "0+unknown"
