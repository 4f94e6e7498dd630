"""afd-mrv2: one shared multi-stream pipeline for Attention-FFN Disaggregation on vLLM MRV2.

The names exported here are the public hook API (:mod:`afd_mrv2.api` lists and
documents them; :data:`HOOK_API_VERSION` is its version).  Beyond it:

* :mod:`afd_mrv2.hookspecs`: the hook specifications, the extension manual;
* :mod:`afd_mrv2.config`: the typed ``additional_config["afd"]`` section;
* the command line, ``afd-mrv2 --help``.
"""

from __future__ import annotations

from afd_mrv2 import api
from afd_mrv2.api import *  # noqa: F403 - the package exports exactly the declared API
from afd_mrv2.plugins import package_version

__all__ = [*api.__all__, "__version__"]

__version__ = package_version()
