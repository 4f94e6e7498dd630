"""Composition with vLLM ModelRunner V2: subclass the platform runner, wrap what it built.

* :mod:`~afd_mrv2.mrv2.upstream`: the typed adapter holding the upstream classes used
  (resolved once, from the compat decision's platform);
* :mod:`~afd_mrv2.mrv2.ubatch_runner`: the UBatchRunner subclass whose comm/capture streams
  come from the ``create_streams`` hook;
* :mod:`~afd_mrv2.mrv2.exchange`: per-microbatch AFD transfers as executor work items;
* :mod:`~afd_mrv2.mrv2.runner`: the Attention-side runner class factory;
* :mod:`~afd_mrv2.mrv2.ffn`: the FFN-side loop driven by the executor;
* :mod:`~afd_mrv2.mrv2.worker`: the vLLM workers that build it (``_make_model_runner`` on vLLM 0.33,
  ``CPUWorker.init_device`` under the V2 runner on CPU).

No module here assigns to an attribute of an upstream class or module.
"""

#: afd-mrv2's vLLM worker extension (``--worker-extension-cls``), named here without
#: importing it (it imports vLLM): every role process of ``afd-mrv2 serve`` gets it.
WORKER_EXTENSION = "afd_mrv2.mrv2.worker_ext.AfdWorkerExtension"
