"""``afd-mrv2 probe npu``: establish on Ascend hardware what the CAM operators do with streams.

Writes the evidence document; :func:`skipped_evidence` when there is no NPU.

See docs/internals/cam-connectors.md, "afd_mrv2.probe.npu".
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from afd_mrv2.hooks.cam.camasync import CAMASYNC
from afd_mrv2.hooks.cam.camp2p import CAMP2P
from afd_mrv2.hooks.cam.evidence import Check, Evidence, OpEvidence, StreamBehaviour, environment_block
from afd_mrv2.probe.stage_identity import (
    H,
    K,
    T,
    camasync_stage_rows,
    camasync_stages,
    camp2p_stage_row,
    skipped_rows,
)

OPTIONAL_LIBRARIES = ("umdk_cam_op_lib",)
#: the CAM connectors the probe covers, with their operators
FAMILIES = (CAMP2P, CAMASYNC)


class NoNpu(RuntimeError):
    """No usable Ascend NPU here; the message says what is missing."""


def require_npus(count: int = 2) -> None:
    """Raise :class:`NoNpu` unless torch_npu imports and ``count`` NPUs are visible."""
    if importlib.util.find_spec("torch_npu") is None:
        raise NoNpu("torch_npu is not installed (the probe needs torch_npu, CANN and two Ascend NPUs)")
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # noqa: BLE001 - any import failure means no usable NPU
        raise NoNpu(
            f"torch_npu does not import ({type(exc).__name__}: {exc}); is CANN installed and sourced?"
        ) from None
    npu = torch.npu  # type: ignore[attr-defined]  # torch_npu adds torch.npu at import; torch declares no such attribute
    available = npu.device_count() if npu.is_available() else 0
    if available < count:
        raise NoNpu(f"the probe needs {count} NPUs (one attention rank, one FFN rank); torch.npu sees {available}")


class _Rank:
    """This process: its device, groups, a stream-holding kernel and small helpers."""

    def __init__(self, rank: int, port: int, window_s: float) -> None:
        import torch.distributed as dist

        self.rank, self.dist, self.window_s = rank, dist, window_s
        self.npu = torch.npu  # type: ignore[attr-defined]  # torch_npu adds torch.npu at import; torch declares no such attribute
        self.npu.set_device(rank)
        self.device = torch.device(f"npu:{rank}")
        dist.init_process_group("hccl", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
        self.gloo = dist.new_group(backend="gloo")
        groups = [dist.new_group(backend="hccl") for _ in range(2)]  # one HCCL group per stage
        self.names = [str(g._get_backend(self.device).get_hccl_comm_name(rank)) for g in groups]
        self._x = torch.randn(2048, 2048, device=self.device)
        self.npu.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            self._x = torch.tanh(self._x @ self._x)
        self.npu.synchronize()
        self._steps = max(1, int(window_s / ((time.perf_counter() - start) / 10)))

    def hold(self) -> None:
        """Keep the current stream busy for about ``window_s``."""
        for _ in range(self._steps):
            self._x = torch.tanh(self._x @ self._x)

    def busy(self) -> bool:
        return not self.npu.current_stream().query()

    def side_read(self, t: torch.Tensor) -> torch.Tensor:
        side = self.npu.Stream()
        with self.npu.stream(side):
            host = t.to("cpu", non_blocking=True)
        side.synchronize()
        return host

    def barrier(self) -> None:
        self.dist.barrier(group=self.gloo)

    def gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None, None]
        self.dist.all_gather_object(out, value, group=self.gloo)
        return out

    def data(self, seed: int, rows: int = T, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(rows, H, generator=g).to(self.device, dtype)


def _escape(
    me: _Rank, sender: int, send: Callable[[], Any], recv: Callable[[], torch.Tensor]
) -> dict[str, tuple[str, str]]:
    """Escape-check one send/recv pair both ways; each rank returns what it measured."""
    found: dict[str, tuple[str, str]] = {}
    me.barrier()
    if me.rank != sender:  # receiver held; the sender sends once the receive is queued
        me.hold()
        out = recv()
        me.barrier()
        snapshots = []
        deadline = time.monotonic() + me.window_s * 0.6
        while time.monotonic() < deadline and me.busy():
            snapshots.append(me.side_read(out))
            time.sleep(me.window_s / 30)
        me.npu.synchronize()
        final = out.cpu()
        if any(torch.equal(s, final) for s in snapshots):
            found["recv"] = ("foreign", "output final while the caller's stream was still busy")
        elif snapshots:
            found["recv"] = ("current", f"output not written during {len(snapshots)} reads of the busy window")
        else:
            found["recv"] = ("unverified", "busy window ended before the first read; raise --window-ms")
    else:
        me.barrier()
        send()
        me.npu.synchronize()
    me.barrier()
    if me.rank == sender:  # sender held; the receiver reports whether it finished meanwhile
        me.hold()
        send()
        me.barrier()
        peer_done = me.gather(None)[1 - sender]
        still_busy = me.busy()
        me.npu.synchronize()
        if peer_done and still_busy:
            found["send"] = ("foreign", "peer received while the sender's stream was still busy")
        elif still_busy:
            found["send"] = ("current", "peer waited for the sender's stream")
        else:
            found["send"] = ("unverified", "busy window ended before the peer reported; raise --window-ms")
    else:
        me.barrier()
        out = recv()
        done = me.npu.Event()
        done.record()
        deadline = time.monotonic() + me.window_s * 0.6
        while time.monotonic() < deadline and not done.query():
            time.sleep(me.window_s / 30)
        me.gather(bool(done.query()))
        me.npu.synchronize()
        del out
    me.barrier()
    return found


def _camp2p(me: _Rank, ops: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """FFN = rank 0 (world 0), attention = rank 1 (world 1); a2e then e2a, per stage group."""
    empty = torch.empty((0, H), dtype=torch.bfloat16, device=me.device)
    ids, scales = torch.empty(0, dtype=torch.int32, device=me.device), torch.empty(0, device=me.device)
    counts = torch.tensor([T], dtype=torch.int32, device=me.device)

    def a2e_send(stage: int = 0, seed: int = 1) -> Any:
        return ops["a2e"](me.data(seed), None, None, T, H, K, 1, 1, 1, me.names[stage], 8, 0)

    def a2e_recv(stage: int = 0) -> torch.Tensor:
        out: torch.Tensor = ops["a2e"](empty, ids, scales, T, H, K, 1, 1, 0, me.names[stage], 8, 0)[0]
        return out

    def e2a_send(stage: int = 0, seed: int = 2) -> Any:
        return ops["e2a"](me.data(seed), counts, T, H, K, 1, 1, 0, me.names[stage], 8)

    def e2a_recv(stage: int = 0) -> torch.Tensor:
        out: torch.Tensor = ops["e2a"](me.data(0), counts, T, H, K, 1, 1, 1, me.names[stage], 8)
        return out

    a2e = _escape(me, 1, a2e_send, a2e_recv)
    e2a = _escape(me, 0, e2a_send, e2a_recv)
    if me.rank == 1:  # two stages in flight at once, each on its own group
        a2e_send(0, 11), a2e_send(1, 12)
        back = [e2a_recv(0), e2a_recv(1)]
    else:
        got = [a2e_recv(0), a2e_recv(1)]
        e2a_send(0, 21), e2a_send(1, 22)
    me.npu.synchronize()
    ok = (
        all(torch.equal(g.cpu(), me.data(s).cpu()) for g, s in zip(got, (11, 12), strict=True))
        if me.rank == 0
        else all(torch.equal(b.cpu(), me.data(s).cpu()) for b, s in zip(back, (21, 22), strict=True))
    )
    return {"a2e": a2e, "e2a": e2a}, ok


def _camasync(me: _Rank, ops: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Attention = rank 0 (world 0), FFN = rank 1 (world 1), one FFN rank holding all experts."""
    experts, seq = 8, 256
    comm_args = torch.empty((1,), dtype=torch.float16, device=me.device)
    ids = (torch.arange(T * K).reshape(T, K) % experts).to(me.device, torch.int32)
    weights = torch.full((T, K), 0.5, device=me.device)
    place = torch.empty((1,), dtype=torch.bfloat16, device=me.device)
    common = (1, 1, experts)
    received: list[Any] = []

    def dispatch_send(layer: int = 0, seed: int = 1) -> Any:
        return ops["async_dispatch_send"](
            me.data(seed), ids, comm_args, 0, seq, T, H, K, *common, 0, 2, layer, 1, 0, me.names[0]
        )

    def dispatch_recv() -> torch.Tensor:
        out = ops["async_dispatch_recv"](place, comm_args, 0, seq, H, K, *common, 1, 2, 1, 0, me.names[0])
        received.append(out)
        counts: torch.Tensor = out[4]  # token_nums_rankid_layeridx
        return counts

    def combine_send() -> Any:
        expand_x, shared, _, _, header, counts, _ = received.pop(0)
        rows = max(1, int(counts.sum()))
        return ops["async_combine_send"](
            expand_x[:rows], shared, comm_args, header, 0, seq, H, K, *common, 1, 2, 1, me.names[0]
        )

    def combine_recv() -> torch.Tensor:
        out: torch.Tensor = ops["async_combine_recv"](
            place, ids, weights, comm_args, 0, T, H, K, *common, 0, 2, me.names[0]
        )
        return out

    dispatch = _escape(me, 0, dispatch_send, dispatch_recv)  # the receiver keeps both payloads for the combines
    combine = _escape(me, 1, combine_send, combine_recv)
    found: dict[str, dict[str, Any]] = {
        "async_dispatch_send": {"send": dispatch.get("send")},
        "async_dispatch_recv": {"recv": dispatch.get("recv")},
        "async_combine_send": {"send": combine.get("send")},
        "async_combine_recv": {"recv": combine.get("recv")},
    }
    if me.rank == 0:  # two dispatches in flight (layers 5 and 6), then their combines
        dispatch_send(5, 31), dispatch_send(6, 32)
        outs = [combine_recv(), combine_recv()]
        me.npu.synchronize()
        ok = all(bool(torch.isfinite(o).all()) for o in outs) and not torch.equal(outs[0], outs[1])
    else:
        headers = [dispatch_recv().cpu().tolist(), dispatch_recv().cpu().tolist()]
        combine_send(), combine_send()
        me.npu.synchronize()
        ok = [h[2] for h in headers] == [5, 6]
    return {k: {d: v for d, v in found[k].items() if v is not None} for k in found}, ok


def _behaviour(per_rank: list[dict[str, Any]]) -> tuple[StreamBehaviour, str]:
    results = [r for d in per_rank for r in d.values()]
    kinds = {kind for kind, _ in results}
    detail = "; ".join(f"{d}: {why}" for rank in per_rank for d, (_, why) in rank.items())
    if "foreign" in kinds:
        return StreamBehaviour.FOREIGN, detail
    if kinds == {"current"}:
        return StreamBehaviour.CURRENT, detail
    return StreamBehaviour.UNVERIFIED, detail or "no measurement"


def _compare(me: _Rank, connector: str, evidence_path: str) -> dict[str, Any]:
    """The toy MoE through the real connector and executor: serialized vs multistream."""
    from afd_mrv2.probe.cluster import ClusterSpec, run_rank
    from afd_mrv2.probe.toy import ToyMoE

    model = ToyMoE.build(hidden=H, num_experts=8, topk=K, num_layers=4).to(me.device, torch.bfloat16)
    spec = ClusterSpec(
        connector, batches=((5, 3, 4, 4),), backend="accelerator", extra={"stream_evidence": evidence_path}
    )
    ffn_first = connector == "camp2p"
    role = ("ffn" if me.rank == 0 else "attention") if ffn_first else ("attention" if me.rank == 0 else "ffn")
    resources = {"hccl_groups": tuple(me.names), "cam_group": me.names[0], "device": str(me.device)}
    outputs: dict[str, Any] = {}
    for mode, multistream in (("serialized", False), ("multistream", True)):
        try:
            result = run_rank(replace(spec, multistream=multistream), model, role, 0, ops=None, resources=resources)
            outputs[mode] = None if result.output is None else result.output.float().cpu()
        except Exception as exc:  # noqa: BLE001 - recorded in the evidence; the probe goes on
            outputs[mode] = f"{type(exc).__name__}: {exc}"
        me.barrier()
    attention = me.gather(outputs)[1 if ffn_first else 0]
    serial, multi = attention["serialized"], attention["multistream"]
    if isinstance(serial, torch.Tensor) and isinstance(multi, torch.Tensor):
        return {"equal": bool(torch.equal(serial, multi)), "max_abs_diff": float((serial - multi).abs().max())}
    return {"serialized": str(serial), "multistream": str(multi)}


def skipped_evidence(why: str, versions: dict[str, str] | None = None) -> Evidence:
    """The probe's document where it could not run: every row it makes, ``skipped: <why>``."""
    operators: dict[str, OpEvidence] = {}
    comparisons: dict[str, Any] = {}
    checks: list[Check] = []
    for family in FAMILIES:
        for name in family.ops:
            qualname = f"{family.namespace}.{name}"
            operators[qualname] = OpEvidence(qualname, False, detail=f"skipped: {why}")
        comparisons[family.name] = {"skipped": why}
        checks += skipped_rows(family.name, why)
    return Evidence(
        versions or {}, operators, comparisons, tuple(checks), context=environment_block(accelerator="none")
    )


def probe_rank(rank: int, port: int, out: str, window_s: float) -> None:
    """One probe process; :func:`run_probe` spawns two."""
    from afd_mrv2.hooks.cam.ops import installed_versions, resolve_torch_ops

    for library in OPTIONAL_LIBRARIES:
        if importlib.util.find_spec(library) is not None:
            importlib.import_module(library)  # registers torch.ops.<library>
    me = _Rank(rank, port, window_s)
    environment = installed_versions()
    context = environment_block(accelerator=f"npu: {me.npu.device_count()} visible, probe on npu:0 and npu:1")
    operators: dict[str, OpEvidence] = {}
    comparisons: dict[str, Any] = {}
    identity: list[Check] = []
    for family, measure in ((CAMP2P, _camp2p), (CAMASYNC, _camasync)):
        resolved = resolve_torch_ops(family.namespace, family.ops)
        if not all(me.gather(all(fn is not None for fn in resolved.values()))):
            why = "operators not registered on every rank"
            for name, fn in resolved.items():
                qualname = f"{family.namespace}.{name}"
                operators[qualname] = OpEvidence(qualname, fn is not None, detail=f"skipped: {why}")
            comparisons[family.name] = {"skipped": why}
            identity += skipped_rows(family.name, why)
            continue
        found, safe = measure(me, resolved)
        per_rank_found, per_rank_safe = me.gather(found), me.gather(safe)
        for name in family.ops:
            stream, detail = _behaviour([r.get(name, {}) for r in per_rank_found])
            home = "default" if stream is StreamBehaviour.FOREIGN else None
            operators[f"{family.namespace}.{name}"] = OpEvidence(
                f"{family.namespace}.{name}", True, stream, home, all(per_rank_safe), detail
            )
        if family is CAMP2P:  # its in-flight check sends each stage on its own group
            identity.append(camp2p_stage_row(all(per_rank_safe), len(me.names)))
        else:
            attention, ffn = me.gather(camasync_stages(me, resolved))
            identity += camasync_stage_rows(attention, ffn)
        partial = f"{out}.rank{rank}.partial.json"
        Evidence(environment, operators).write(partial)
        comparisons[family.name] = _compare(me, family.name, partial)
    if rank == 0:
        Evidence(environment, operators, comparisons, tuple(identity), context=context).write(out)
    me.barrier()
    me.dist.destroy_process_group()


def run_probe(out: str | Path, *, window_s: float = 0.2, port: int = 29533) -> Path:
    """Check for NPUs, spawn the two probe processes, return the evidence path."""
    require_npus(2)
    import torch.multiprocessing as mp

    mp.spawn(probe_rank, args=(port, str(out), window_s), nprocs=2, join=True)
    return Path(out)
