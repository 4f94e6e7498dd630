"""Stand-ins for the upstream vLLM / vLLM-Ascend symbols afd-mrv2 composes with.

They live at the same module paths as upstream (``standins/vllm/v1/worker/gpu/ubatch_utils.py``
stands for ``vllm.v1.worker.gpu.ubatch_utils``) and implement the exact upstream
signatures the seams in :mod:`afd_mrv2.compat.seams` declare; ``tests/test_contracts.py``
runs the same contracts over this tree, so a stand-in cannot drift from upstream's
signatures without a test failing.  Behaviour is reduced to what the composition
needs (our own simplified code, not upstream's): microbatch threads that hand off
to each other at ``dbo_yield``, streams that are plain marker objects.

Imports inside are relative, so they import as ``standins.vllm...`` and never
shadow a real vLLM.  ``EVENTS`` records what upstream constructors ran, so tests can
prove that afd-mrv2 refused before any of them.
"""

EVENTS: list[str] = []
