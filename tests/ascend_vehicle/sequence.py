"""One worker's start-up registrations on vLLM-Ascend, for real, in a fresh process (the CPU vehicle).

Run by ``tests/ascend_vehicle/test_registration.py`` with the vehicle's interpreter and
``PYTHONPATH`` = the NPU stubs (``tests/support/npu_stubs``) and the unpacked vllm-ascend
0.30.0rc2 sdist.  It is ``afd-mrv2 probe ascend``'s own registration child
(:mod:`afd_mrv2.probe.ascend_registration`: steps ``plugins``, ``ascend``, ``afd``) plus one step
of the tests' own: ``legacy`` replays afd-mrv2 0.2's plugin (an unconditional
``register_routed_experts()``), the crash the vehicle keeps as its negative control.
argv[1] is the order, argv[2] the ``additional_config`` JSON; it prints the child's one line.
"""

from __future__ import annotations

import json
import sys

from afd_mrv2.probe.ascend_registration import PREFIX, STEPS, run_steps


def _legacy(vllm_config: object) -> None:
    from afd_mrv2.mrv2.attention.experts import register_routed_experts

    register_routed_experts()


if __name__ == "__main__":
    print(PREFIX + json.dumps(run_steps(sys.argv[1], sys.argv[2], {**STEPS, "legacy": _legacy})), flush=True)
