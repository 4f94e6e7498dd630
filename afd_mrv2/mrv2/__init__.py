"""Composition with vLLM ModelRunner V2, by role; no module here assigns to an upstream attribute.

* :mod:`~afd_mrv2.mrv2.attention`: the Attention side: the MoE seam (the out-of-tree routed-experts
  layer), remote experts, the per-micro-batch exchange, the V2 runners and micro-batching, the worker;
* :mod:`~afd_mrv2.mrv2.ffn`: the FFN side: the role process, the server, its loop, report and leader watch;
* :mod:`~afd_mrv2.mrv2.transport`: the pair transport: the rendezvous store (key layout, incarnations, the
  pair handshake), the links built on it, rejoin;
* :mod:`~afd_mrv2.mrv2.upstream`, :mod:`~afd_mrv2.mrv2.engine_args`, :mod:`~afd_mrv2.mrv2.deployment`,
  :mod:`~afd_mrv2.mrv2.extension`: what both roles share (the typed upstream adapter, vLLM engine
  arguments, admission, the worker extension every role process gets).
"""

#: afd-mrv2's vLLM worker extension (``--worker-extension-cls``), named here without
#: importing it (it imports vLLM): every role process of ``afd-mrv2 serve`` gets it.
WORKER_EXTENSION = "afd_mrv2.mrv2.extension.AfdWorkerExtension"
