"""Run the toy MoE across attention and FFN ranks through the shared executor.

:func:`run_rank` is one rank's whole run: build its config and connector (the
real ``camp2p`` / ``camasync`` entry points), plan its stages, drive the
executor over the work items of :mod:`afd_mrv2.stages.pairing`, and return what
it produced.  :func:`run_in_threads` runs every rank of a :class:`ClusterSpec`
as a thread of this process (for the CPU doubles); ``afd-mrv2 probe npu`` runs
one rank per process on the real operators.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from afd_mrv2.config import AfdConfig, parse_afd_config
from afd_mrv2.devices import DeviceBackend, make_backend
from afd_mrv2.hooks.cam.common import OPS_RESOURCE
from afd_mrv2.hooks.cam.ops import OpSet
from afd_mrv2.pipeline.executor import CloseReport, Executor
from afd_mrv2.plugins import load_plugins, role_context
from afd_mrv2.probe.toy import ToyAttention, ToyMoE, camasync_ffn, camp2p_ffn
from afd_mrv2.stages import Stage, attention_items, ffn_items, merge_tokens, plan_stages
from afd_mrv2.stages.layout import StepDecision, decide_split, unsplit_stage
from afd_mrv2.stages.pairing import attention_buffers


@dataclass(frozen=True)
class ClusterSpec:
    """One AFD deployment of the toy model.

    ``depth`` / ``buffers`` (input, output counts; overrides ``depth``) are the
    FFN ranks' ``multistream`` buffers.  The attention ranks take the only counts
    that pair combine with dispatch (:func:`~afd_mrv2.stages.pairing.attention_buffers`:
    one input and one output buffer with two stages) and stay serialized with one
    stage, where no counts do.
    """

    connector: str  # "camp2p" | "camasync"
    num_attention: int = 1
    num_ffn: int = 1
    batches: tuple[tuple[int, ...], ...] = ((5, 3),)  # per attention rank: tokens per request
    split: str | None = "token"  # async-MoE / ubatch split; None = one stage
    multistream: bool = False
    depth: int = 2
    buffers: tuple[int, int] | None = None
    backend: str = "host"
    dynamic_quant: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return 2 if self.decision().split else 1

    def decision(self) -> StepDecision:
        """Split or not, for every attention rank together: unsplit when any rank's batch has no plan.

        The ranks of one cluster step together (a DP group), so the step is
        decided as :func:`~afd_mrv2.stages.layout.decide_split` decides it: one
        rank with a single request under the request split makes every rank run
        the step unsplit.  Each rank can compute this from the spec (all
        batches are in it), which stands in for the per-step all-gather.
        """
        if self.split is None:
            return StepDecision(split=False, dp_max_tokens=max(sum(b) for b in self.batches), why="no split")
        rows = [[int(plan_stages(b, split=self.split) is not None), sum(b), len(b)] for b in self.batches]
        return decide_split(
            bool(rows[0][0]), rows[0][1], rows[0][2], lambda _mine: rows, name_of=lambda r: f"attention rank {r}"
        )

    def stages(self, rank: int) -> tuple[Stage, ...]:
        counts = self.batches[rank]
        plan = plan_stages(counts, split=self.split) if self.split is not None and self.decision().split else None
        return plan if plan is not None else (unsplit_stage(counts),)

    def config(self, role: str) -> AfdConfig:
        camasync = self.connector == "camasync"
        multistream: dict[str, Any] = {"enabled": self.multistream, "depth": self.depth, "backend": self.backend}
        attention = attention_buffers(self.num_stages)
        multistream["roles"] = ["ffn"] if attention is None else ["attention", "ffn"]
        buffers = attention if role == "attention" else self.buffers
        if buffers is not None:
            multistream["buffers"] = {"in": buffers[0], "out": buffers[1]}
        raw: dict[str, Any] = {
            "connector": self.connector,
            "role": role,
            "num_attention_ranks": self.num_attention,
            "num_ffn_ranks": self.num_ffn,
            "async": camasync,
            "compute_gate_on_attention": camasync,
            "multistream": multistream,
            "connector_extra_config": {
                **({"dynamicQuant": self.dynamic_quant, "max_seq_len": 256} if camasync else {}),
                **self.extra,
            },
        }
        if camasync and self.num_stages == 2:
            raw["async_moe"] = {"enabled": True, "split": self.split}
        return parse_afd_config(raw)


@dataclass
class RankResult:
    role: str
    rank: int
    output: torch.Tensor | None
    report: CloseReport
    backend: DeviceBackend
    connector: Any


def run_rank(
    spec: ClusterSpec,
    model: ToyMoE,
    role: str,
    rank: int,
    *,
    ops: OpSet | None,
    resources: Mapping[str, Any] | None = None,
    backend: DeviceBackend | None = None,
) -> RankResult:
    """One rank's run; ``ops`` None means the real operators (resolved by the connector)."""
    config = spec.config(role)
    backend = backend or make_backend(spec.backend)
    res: dict[str, Any] = {"model": model.spec, "role_rank": rank, **(resources or {})}
    if ops is not None:
        res[OPS_RESOURCE] = ops
    res.setdefault("hccl_groups", tuple(f"afd{s}" for s in range(spec.num_stages)))
    res.setdefault("cam_group", "afd_async_cam")
    stages: tuple[Stage, ...] = ()
    outputs: dict[int, torch.Tensor] = {}
    layers = model.spec.num_layers
    if role == "attention":
        stages = spec.stages(rank)
        h0 = model.embed(rank, sum(spec.batches[rank]))
        res["source"] = lambda item: h0[stages[item.stage_idx].token_slice].clone()
        res["sink"] = lambda item, out: outputs.__setitem__(item.stage_idx, out)
        compute: Callable[..., Any] = ToyAttention(model, dispatch_routing=spec.connector == "camasync")
        items = list(attention_items(layers, spec.num_stages))
    elif spec.connector == "camp2p":
        plans = [spec.stages(a) for a in range(spec.num_attention)]
        res["stage_token_counts"] = lambda item: [p[item.stage_idx].num_tokens for p in plans]
        compute = camp2p_ffn(model)
        items = list(ffn_items(layers, spec.num_stages))
    else:
        compute = camasync_ffn(model, rank, -(-model.spec.num_experts // spec.num_ffn))
        items = list(ffn_items(layers, spec.num_stages, sources=spec.num_attention))
    plugins = load_plugins(role_context(config, **res))
    executor = Executor(plugins, backend, config.multistream, compute=compute, role=role)
    try:
        executor.run(items)
    finally:
        report = executor.close()
    output = merge_tokens([outputs[s.index] for s in stages], stages) if role == "attention" else None
    return RankResult(role, rank, output, report, backend, plugins.connector)


def world_rank(spec: ClusterSpec, role: str, rank: int) -> int:
    """The operators' rank numbering: CAMP2P puts FFN first, CAMAsync attention first."""
    if spec.connector == "camp2p":
        return rank if role == "ffn" else spec.num_ffn + rank
    return rank if role == "attention" else spec.num_attention + rank


def ranks(spec: ClusterSpec) -> list[tuple[str, int]]:
    return [("attention", a) for a in range(spec.num_attention)] + [("ffn", f) for f in range(spec.num_ffn)]


def run_in_threads(
    spec: ClusterSpec,
    model: ToyMoE,
    make_ops: Callable[[str, int], OpSet],
    *,
    abort: Callable[[], None] = lambda: None,
    timeout_s: float = 60.0,
    backends: Mapping[tuple[str, int], DeviceBackend] | None = None,
) -> dict[tuple[str, int], RankResult]:
    """Every rank of ``spec`` on its own thread; the first failure aborts the others and is raised."""
    results: dict[tuple[str, int], RankResult] = {}
    errors: list[BaseException] = []

    def one(role: str, rank: int) -> None:
        try:
            backend = (backends or {}).get((role, rank))
            results[(role, rank)] = run_rank(spec, model, role, rank, ops=make_ops(role, rank), backend=backend)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            errors.append(exc)
            abort()

    threads = [
        threading.Thread(target=one, args=key, name=f"rank-{key[0]}{key[1]}", daemon=True) for key in ranks(spec)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        abort()
        raise TimeoutError(f"cluster run did not finish within {timeout_s:g} s")
    return results


def reference(spec: ClusterSpec, model: ToyMoE) -> dict[int, torch.Tensor]:
    """The unsplit single-process result of each attention rank."""
    return {a: model.forward(model.embed(a, sum(spec.batches[a]))) for a in range(spec.num_attention)}


def with_mode(spec: ClusterSpec, *, multistream: bool) -> ClusterSpec:
    return replace(spec, multistream=multistream)
