"""One rank of ``afd-mrv2 run``: an attention or FFN process of the embedded AFD deployment.

See docs/internals/reference.md, "afd_mrv2.reference.worker".
"""

from __future__ import annotations

import datetime
import logging
import os
import resource
import signal
import socket
import statistics
import sys
import time
import traceback
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from afd_mrv2 import envs
from afd_mrv2.config import parse_afd_config
from afd_mrv2.devices import make_backend
from afd_mrv2.errors import AfdError
from afd_mrv2.hooks.p2p import P2pShape, PeerError, PeerLink
from afd_mrv2.mrv2.transport.store import PairTransport, route_address
from afd_mrv2.pipeline.executor import Executor
from afd_mrv2.pipeline.trace import Trace
from afd_mrv2.plugins import load_plugins, role_context
from afd_mrv2.procs import die_with_parent
from afd_mrv2.reference.batches import concat, make_batch
from afd_mrv2.reference.buffer_report import buffer_block, counts_label
from afd_mrv2.reference.forward import reference_forward
from afd_mrv2.reference.owners import AttentionOwner, FfnOwner, Schedule
from afd_mrv2.reference.pairs import open_pair_link
from afd_mrv2.reference.progress import progress
from afd_mrv2.reference.quant_check import MoeCheck
from afd_mrv2.reference.runconfig import RunConfig
from afd_mrv2.reference.split_owner import SplitAttentionOwner
from afd_mrv2.reference.split_steps import all_gather, decide_batches, groups, layout_log
from afd_mrv2.reference.weights import build_weights
from afd_mrv2.stages.layout import layout_log_enabled
from afd_mrv2.topology import ATTENTION

LAUNCHER_ENV = envs.LAUNCHER.name  # the launcher's pid, set in the workers it starts


def run_worker(cfg: RunConfig, *, as_json: bool = False) -> int:
    """Run this process's rank, as described by the torchrun environment variables.

    Rank 0 prints the report (``as_json``: one JSON object) unless a local launcher
    started it; the launcher prints it then.
    """
    try:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError) as exc:
        raise AfdError(f"worker mode needs RANK and WORLD_SIZE (and MASTER_ADDR, MASTER_PORT): {exc}") from None
    topology = cfg.topology
    if world_size != topology.world_size:
        raise AfdError(
            f"WORLD_SIZE is {world_size} but --attention {cfg.num_attention} + --ffn {cfg.num_ffn} "
            f"needs {topology.world_size} processes"
        )
    launcher = envs.launcher_pid()
    if launcher is not None:
        _die_with_parent(launcher)
    torch.set_num_threads(1)
    # This worker reports a failure itself, in one line; the executor's own warning would repeat it.
    logging.getLogger("afd_mrv2.pipeline.executor").setLevel(logging.ERROR)
    link: PeerLink | None = None
    try:
        link = _open_link(cfg, rank, world_size)
        code = _Session(cfg, link, as_json=as_json).run()
        link.close(timeout_s=cfg.recv_timeout_s)
        dist.destroy_process_group()
        return code
    except BaseException as exc:  # noqa: BLE001 - every failure ends the process the same way
        _fail(exc, link, topology.describe(rank))
        raise AssertionError("unreachable") from None


def _open_link(cfg: RunConfig, rank: int, world_size: int) -> PeerLink:
    """torch.distributed on gloo for every rank (collectives, and the link on ``--transport gloo``), and this
    rank's PeerLink: on the one group, or on zmq or tcp pairs joined through the same store."""
    timeout = datetime.timedelta(seconds=max(60.0, 3 * cfg.recv_timeout_s))
    store = None
    if cfg.transport == "gloo":
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
    else:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        # as env:// does: under torchrun's agent the agent hosts the store, else rank 0
        master = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        store = dist.TCPStore(host, port, world_size, is_master=master, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    labels: list[Any] = [None] * world_size
    dist.all_gather_object(labels, f"pid {os.getpid()} on {socket.gethostname()}")
    if store is None:
        return PeerLink(cfg.topology, rank, labels=dict(enumerate(labels)))
    transport = PairTransport(cfg.transport, route_address(host, port))
    return open_pair_link(
        cfg.topology, rank, store, transport, labels=dict(enumerate(labels)), timeout_s=timeout.total_seconds()
    )


class _Session:
    """The modes of one rank, run back to back on one PeerLink."""

    def __init__(self, cfg: RunConfig, link: PeerLink, *, as_json: bool) -> None:
        self.cfg, self.link, self.as_json = cfg, link, as_json
        self.rank, self.role = link.rank, link.role
        self.spec = cfg.routed_model
        self.weights = build_weights(self.spec)
        all_batches = range(cfg.warmup + cfg.batches)
        tp = cfg.attention_tp
        tp_group, attention_group = groups(cfg)
        decisions = decide_batches(cfg, self.spec.vocab_size, all_batches, self.role, attention_group)
        self.schedule = Schedule(
            self.spec.num_layers, cfg.num_stages, {b: 1 for b, d in decisions.items() if not d.split}
        )
        self.shape = P2pShape(
            hidden_size=self.spec.hidden_size,
            top_k=self.spec.top_k,
            num_experts=self.spec.num_experts,
            num_layers=self.spec.num_layers,
            max_tokens=cfg.max_item_tokens,
        )
        self.owner: AttentionOwner | FfnOwner
        if self.role == ATTENTION:
            dp = link.index // tp
            batches = {b: make_batch(cfg.batch_spec_for(dp, b), self.spec.vocab_size, dp, b) for b in all_batches}
            if cfg.async_moe_split:
                group = tp_group[dp] if tp_group else None
                self.owner = SplitAttentionOwner(
                    self.spec,
                    self.weights,
                    self.schedule,
                    batches,
                    split=cfg.async_moe_split,
                    layout=cfg.layout,
                    tp_size=tp,
                    tp_rank=link.index % tp,
                    tp_gather=partial(all_gather, group=group) if group is not None else None,
                    decisions=decisions,
                    name=f"attention dp {dp} tp {link.index % tp} (global rank {link.rank})",
                    log=layout_log if layout_log_enabled() else None,
                )
            else:
                self.owner = AttentionOwner(self.spec, self.weights, self.schedule, batches)
        else:
            self.owner = FfnOwner(self.spec, self.weights, cfg.topology, link.index)
        self.references: dict[int, torch.Tensor] = {}  # batch -> reference output, computed on first use
        # --quant: each MoE output is checked against the float MoE within the derived int8 bound
        checked = cfg.quant is not None and isinstance(self.owner, AttentionOwner)
        self.moe_check = MoeCheck(self.owner.compute, self.weights, self.spec) if checked else None
        self.compute = self.moe_check or self.owner.compute

    def _reference(self, batch: int) -> torch.Tensor:
        assert isinstance(self.owner, AttentionOwner)
        whole = concat(self.owner.batches[batch])
        return reference_forward(self.weights, self.spec, whole.tokens, whole.lengths)

    def say(self, message: str) -> None:
        if self.rank == 0:
            progress(message)

    def run(self) -> int:
        cfg = self.cfg
        extra: dict[str, Any] = {"recv_timeout_s": cfg.recv_timeout_s}
        if cfg.quant is not None:
            extra["quant"] = cfg.quant
        sim_latency_us = None
        if cfg.link == "sim":
            sim_latency_us = cfg.sim_latency_us if cfg.sim_latency_us is not None else self._calibrate(extra)
            extra.update(sim_latency_us=sim_latency_us, sim_bandwidth_gbps=cfg.sim_bandwidth_gbps)
        modes = [("serialized", False, (1, 1))] + [
            (f"multistream {counts_label(*counts)}", True, counts) for counts in cfg.modes
        ]
        results = []
        for i, (label, pipelined, counts) in enumerate(modes, 1):
            self.say(f"[{i}/{len(modes)}] {label}: {cfg.warmup} warm-up + {cfg.batches} measured batches ...")
            result = self._run_mode(label, pipelined, counts, extra)
            results.append(result)
            self.say(
                f"[{i}/{len(modes)}] {label}: {result['wall_s'] * 1e3 / (cfg.batches * self.spec.num_layers):.2f} ms per layer"
            )
        mine = {
            "rank": self.rank,
            "role": self.role,
            "index": self.link.index,
            "name": self.link.me,
            "modes": results,
        }
        if isinstance(self.owner, SplitAttentionOwner):
            mine["split"] = {b: plan.summary() for b, plan in sorted(self.owner.plans.items())}
            mine["layouts"] = {b: [s.as_dict() for s in ls] for b, ls in sorted(self.owner.layouts.items())}
        gathered: list[Any] | None = [None] * self.link.topology.world_size if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if self.rank != 0:
            return 0
        from afd_mrv2.reference.report import build_report, render, write_outputs

        report = write_outputs(cfg, build_report(cfg, gathered or [], sim_latency_us=sim_latency_us), gathered or [])
        if envs.launcher_pid() is None:
            print(render(report, as_json=self.as_json), flush=True)
        return 0 if report["ok"] else 1

    def _executor(
        self, label: str, pipelined: bool, counts: tuple[int, int], extra: dict[str, Any]
    ) -> tuple[Executor, Trace]:
        cfg = self.cfg
        config = parse_afd_config(
            {
                "connector": cfg.connector,
                "observers": list(cfg.observers),
                "role": self.role,
                "num_attention_ranks": cfg.num_attention,
                "num_ffn_ranks": cfg.num_ffn,
                "connector_extra_config": extra,
                "multistream": {
                    "enabled": pipelined,
                    "buffers": {"in": counts[0], "out": counts[1]},
                    "roles": ["attention", "ffn"],
                    "backend": "host",
                    "trace": True,
                },
            }
        )
        plugins = load_plugins(role_context(config, p2p_link=self.link, model=self.shape))
        trace = Trace(rank=self.rank, role=self.role, label=label)
        executor = Executor(
            plugins, make_backend("host"), config.multistream, compute=self.compute, role=self.role, trace=trace
        )
        return executor, trace

    def _run_mode(self, label: str, pipelined: bool, counts: tuple[int, int], extra: dict[str, Any]) -> dict[str, Any]:
        cfg, role = self.cfg, self.role
        warm = range(cfg.warmup)
        measured = range(cfg.warmup, cfg.warmup + cfg.batches)
        executor, trace = self._executor(label, pipelined, counts, extra)
        if self.moe_check is not None:
            self.moe_check.reset()
        with executor:
            executor.run(self.schedule.items(role, warm))
            trace.spans.clear()
            self._reset_owner_stats()
            dist.barrier()
            start, cpu = time.perf_counter(), _cpu_s()
            executor.run(self.schedule.items(role, measured))
            dist.barrier()
            wall, cpu = time.perf_counter() - start, _cpu_s() - cpu
            buffers = buffer_block(executor)  # after drain, before close
        closed = executor.close()
        diff, quant = None, None
        if isinstance(self.owner, AttentionOwner):
            diff = max(self._diff(b) for b in range(cfg.warmup + cfg.batches))
            self.owner.outputs.clear()
        if self.moe_check is not None:  # quantized: the checked quantity is the MoE output (quant_check.py)
            quant = {**self.moe_check.stats(), "end_to_end_max_abs_diff": diff}
            diff = self.moe_check.max_abs_diff
        spans = [
            (
                s.name,
                s.stream_name,
                s.stream_id,
                s.item.layer_idx,
                s.item.stage_idx,
                s.item.seq,
                s.slots,
                s.start_ns,
                s.end_ns,
            )
            for s in trace.spans
            if s.item is not None
        ]
        return {
            "label": label,
            "pipelined": pipelined,
            "depth": max(counts),
            "buffers": buffers,
            "wall_s": wall,
            "cpu_s": cpu,
            "load_average": os.getloadavg()[0],
            "metrics": trace.metrics().as_dict(),
            "max_abs_diff": diff,
            "quant_check": quant,
            "spans": spans,
            "closed": closed.describe(),
            **self._owner_stats(),
        }

    def _diff(self, batch: int) -> float:
        assert isinstance(self.owner, AttentionOwner)
        got = self.owner.output(batch)
        if batch not in self.references:
            self.references[batch] = self._reference(batch)
        return float((got - self.references[batch]).abs().max())

    def _calibrate(self, extra: dict[str, Any]) -> float:
        """Balanced simulated link: latency = the FFN compute time per item, measured on gloo."""
        self.say("calibrating the simulated link (one serialized batch on gloo) ...")
        executor, trace = self._executor("calibration", False, (1, 1), extra)
        with executor:
            executor.run(self.schedule.items(self.role, range(1)))
        executor.close()
        if isinstance(self.owner, AttentionOwner):
            self.owner.outputs.clear()
        computes = [s.duration_ns / 1e3 for s in trace.spans if s.name == "compute"]
        mine = statistics.median(computes) if computes and self.role != ATTENTION else 0.0
        value = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        latency = round(float(value[0]), 1)
        self.say(f"simulated link: {latency:.0f} us per transfer (= median FFN compute per item)")
        return latency

    def _owner_stats(self) -> dict[str, Any]:
        owner = self.owner
        if isinstance(owner, AttentionOwner):
            return {"expert_tokens": owner.expert_tokens.tolist(), "routed_tokens": owner.routed_tokens}
        return {"ffn_tokens": owner.tokens, "ffn_calls": owner.calls}

    def _reset_owner_stats(self) -> None:
        owner = self.owner
        if isinstance(owner, AttentionOwner):
            owner.expert_tokens.zero_()
            owner.routed_tokens = 0
        else:
            owner.tokens = owner.calls = 0


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _fail(exc: BaseException, link: PeerLink | None, me: str) -> None:
    """Report ``exc`` once, tell the peers, and leave now."""
    if isinstance(exc, KeyboardInterrupt):
        message, code = "interrupted", 130
    else:
        code = 1
        message = f"{type(exc).__name__}: {exc}" if not isinstance(exc, AfdError) else str(exc)
        if link is not None and not isinstance(exc, AfdError):
            try:
                link.check_peers()  # a collective that failed because a peer died: name the peer
            except PeerError as named:
                message = f"{named} (seen as: {message.splitlines()[0]})"
        if not isinstance(exc, (AfdError, RuntimeError)):
            traceback.print_exception(exc, file=sys.stderr)
    progress(f"{link.me if link else me} failed: {message}")
    if link is not None:
        link.abort(message)
    sys.stderr.flush()
    os._exit(code)


def _die_with_parent(parent_pid: int) -> None:
    """Linux: get SIGKILL when the launcher dies, so no worker outlives it."""
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)  # the launcher is already gone
