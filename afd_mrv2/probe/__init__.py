"""Operator probes: what the CAM operators do with streams, established by running them.

``evidence`` is the JSON record a probe writes and a connector reads at start-up;
``streams`` classifies an operator's stream behaviour; ``toy`` and ``cluster``
are the small deterministic MoE and the per-rank driver that compare serialized
with multistream outputs (with the CPU test doubles here, with the real
operators on an NPU in ``afd-mrv2 probe npu``).
"""
