"""The embedded AFD deployment: a tiny deterministic MoE model and its launcher.

* :mod:`~afd_mrv2.reference.spec`, :mod:`~afd_mrv2.reference.weights`,
  :mod:`~afd_mrv2.reference.layers`, :mod:`~afd_mrv2.reference.forward`,
  :mod:`~afd_mrv2.reference.batches`: the DeepSeek-V2-style model, seeded, and
  its single-process forward (the ground truth);
* :mod:`~afd_mrv2.reference.kvcache` and :mod:`~afd_mrv2.reference.staged`: the
  model run in the async-MoE planner's two stages (paged KV cache, chunked-prefill
  attention for a request the token split cuts), checked against the ground truth;
* :mod:`~afd_mrv2.reference.owners`: the compute functions each AFD role hands
  to the executor;
* :mod:`~afd_mrv2.reference.worker`: one rank of ``afd-mrv2 run``;
  :mod:`~afd_mrv2.reference.launcher`: starts all ranks on this machine;
  :mod:`~afd_mrv2.reference.report` and :mod:`~afd_mrv2.reference.timeline`:
  what the run prints and draws.
"""
