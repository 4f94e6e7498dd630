"""Run a toy AFD cluster on the CAM doubles (shared by the connector tests)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from afd_mrv2.hooks.cam.evidence import Evidence
from afd_mrv2.probe.cluster import ClusterSpec, RankResult, reference, run_in_threads, world_rank
from afd_mrv2.probe.toy import ToyMoE
from tests.support.cam_fabric import Fabric, Message
from tests.support.camasync_doubles import CamAsyncDoubles
from tests.support.camp2p_doubles import CamP2PDoubles
from tests.support.probe_doubles import probe_camasync, probe_camp2p

# 8 experts on 2 FFN ranks (4 each): layer 1 starves FFN rank 1, layer 2 starves FFN rank 0
MODEL = ToyMoE.build(hidden=16, num_experts=8, topk=2, num_layers=4, starve={1: (4, 8), 2: (0, 4)})


@dataclass
class Run:
    results: dict[tuple[str, int], RankResult]
    doubles: CamP2PDoubles | CamAsyncDoubles
    fabric: Fabric
    evidence: Evidence | None

    def outputs(self) -> dict[int, torch.Tensor]:
        return {rank: r.output for (role, rank), r in self.results.items() if role == "attention"}

    def connectors(self, role: str | None = None) -> list:
        return [r.connector for (ro, _), r in sorted(self.results.items()) if role in (None, ro)]


def run(
    spec: ClusterSpec,
    *,
    foreign: tuple[str, ...] = (),
    delay: Callable[[Message], float] | None = None,
    evidence: Evidence | str | None = "probe",
    backends: dict | None = None,
    lag_s: float = 0.02,
    timeout_s: float = 20.0,
) -> Run:
    fabric = Fabric(delay=delay, timeout_s=timeout_s)
    kind = CamP2PDoubles if spec.connector == "camp2p" else CamAsyncDoubles
    doubles = kind(fabric, foreign=foreign, lag_s=lag_s)
    if evidence == "probe":
        evidence = probe_camp2p(doubles) if spec.connector == "camp2p" else probe_camasync(doubles)
    try:
        results = run_in_threads(
            spec,
            MODEL,
            lambda role, rank: doubles.opset(world_rank(spec, role, rank), evidence),
            abort=fabric.abort,
            timeout_s=timeout_s * 2,
            backends=backends,
        )
    finally:
        doubles.close()
    assert fabric.pending() == 0, "every transfer was consumed"
    return Run(results, doubles, fabric, evidence)


def assert_matches_reference(outputs: dict[int, torch.Tensor], spec: ClusterSpec, atol: float = 1e-5) -> float:
    ref = reference(spec, MODEL)
    worst = 0.0
    for rank, out in outputs.items():
        assert out.shape == ref[rank].shape
        diff = (out - ref[rank]).abs().max().item() if out.numel() else 0.0  # a rank with no tokens
        worst = max(worst, diff)
        assert diff <= atol, f"attention rank {rank}: max |diff| {diff} > {atol}"
    return worst
