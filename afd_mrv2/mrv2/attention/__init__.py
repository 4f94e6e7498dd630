"""The Attention side of AFD in vLLM: the MoE seam, remote experts, the exchange, the runners, micro-batching.

:mod:`.experts` (the out-of-tree routed-experts layer) and :mod:`.standin` (its weight-free quant
method) hand each MoE call to :mod:`.remote`, which runs the transfer through the shared executor
(:mod:`.exchange`); :mod:`.runner`, :mod:`.ubatch_runner`, :mod:`.split_policy` and :mod:`.handoff`
compose the V2 runner and its micro-batches; :mod:`.worker` is ``--worker-cls``.
"""
