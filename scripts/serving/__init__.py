"""The scripts' serving harness: :mod:`afd_mrv2.harness` (servers, client, host), re-exported, plus
:mod:`.matrix` (the serve-against-plain-vLLM rows, whose CPU runners use the test-only Triton stand-in).

A script imports it as ``serving`` (its folder is first on ``sys.path``); the tests import
``scripts.serving``.
"""

from afd_mrv2.harness import *  # noqa: F403 - this package is the harness, as the scripts see it
from afd_mrv2.harness import __all__  # noqa: F401
