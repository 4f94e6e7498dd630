"""``camp2p``: the Ascend CAMP2P connector (``torch.ops.afd_ascend.a2e`` / ``e2a``) as hooks.

Transfer state :class:`CAMP2PTransferState`; :func:`select_group` maps stage -> HCCL group.

See docs/internals/cam-connectors.md, "afd_mrv2.hooks.cam.camp2p".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from afd_mrv2.devices.base import Stream
from afd_mrv2.errors import ConfigError, PluginError
from afd_mrv2.hooks.cam.common import TRANSFER, CamAttentionBase, CamConnectorBase, CamFfnBase
from afd_mrv2.hooks.cam.evidence import StreamBehaviour
from afd_mrv2.hooks.cam.ops import BoundOp, OperatorFamily, OpSet
from afd_mrv2.hooks.cam.options import CamP2POptions, options
from afd_mrv2.hookspecs import ComputeFn, hookimpl
from afd_mrv2.items import WorkItem
from afd_mrv2.plugins import ConnectorContext, FfnContext
from afd_mrv2.stages.pairing import PendingFifo
from afd_mrv2.topology import FFN
from afd_mrv2.work import Work

_SOURCE_BASIS = "afd-plugin torch_binding.cpp launches via EXEC_NPU_CMD on c10_npu::getCurrentNPUStream()"
CAMP2P = OperatorFamily(
    "camp2p", "afd_ascend", ("a2e", "e2a"), {name: (StreamBehaviour.CURRENT, _SOURCE_BASIS) for name in ("a2e", "e2a")}
)


@dataclass(frozen=True)
class CamP2POps:
    """The two CAMP2P operators, typed: ``ops.a2e(stream, *args)`` / ``ops.e2a(stream, *args)``."""

    a2e: BoundOp
    e2a: BoundOp

    @classmethod
    def of(cls, ops: OpSet) -> CamP2POps:
        return cls(ops["a2e"], ops["e2a"])


@dataclass
class CAMP2PTransferState:
    """What a2e returns that e2a needs, per (layer, stage) transfer.

    ``aiv_num``, ``batch_size``, ``h`` and ``k`` size both operators;
    ``atten_batch_size`` (rows per attention rank, from a2e) tells e2a how to
    split the FFN output back; ``x_active_mask`` marks real rows;
    ``cam_p2p_ep_name`` is the FFN's expert-parallel HCCL group; ``group_ep`` the
    stage's AFD group the transfer used (e2a must use the same one);
    ``num_real`` (FFN) the rows actually received (``batch_size`` is at least 1).
    """

    layer_idx: int
    stage_idx: int
    group_ep: str
    aiv_num: int
    batch_size: int
    h: int
    k: int
    atten_batch_size: torch.Tensor | None = None
    x_active_mask: torch.Tensor | None = None
    cam_p2p_ep_name: str | None = None
    reference: torch.Tensor | None = None  # attention: the dispatched hidden states (e2a's shape reference)
    num_real: int = 0
    num_stages: int = 1  # the step's stage count: with layer_idx and stage_idx, the transfer's stage identity

    @property
    def stage_id(self) -> WorkItem:
        return WorkItem.stage(self.layer_idx, self.stage_idx, self.num_stages)


def select_group(stage_idx: int, groups: Sequence[str]) -> str:
    """The HCCL group of ``stage_idx``: one group per stage, so stages never share a FIFO."""
    if not 0 <= stage_idx < len(groups):
        raise PluginError(
            f"camp2p: stage {stage_idx} has no HCCL group (groups for stages 0..{len(groups) - 1}: {list(groups)})"
        )
    return groups[stage_idx]


class CamP2PConnector(CamConnectorBase):
    """The entry point: builds :class:`CamP2PAttention` or :class:`CamP2PFfn` for ``afd.role``.

    Holds what both roles set up alike (options, HCCL groups, operators).
    """

    name = CAMP2P.name
    required_capability = "camp2p"

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        config = self.config
        self.aiv_num = options(config, CamP2POptions).core_num_for(self.role)
        if config.async_moe.enabled:
            raise ConfigError(
                "afd.async_moe.enabled",
                "the async-MoE split needs connector camasync; CAMP2P stages are its HCCL groups",
            )
        if config.compute_gate_on_attention:
            raise ConfigError(
                "afd.compute_gate_on_attention", "CAMP2P computes the MoE gate on the FFN side; expected false"
            )
        typed = context.typed()
        groups = typed.need(typed.hccl_groups, "hccl_groups")
        if (
            isinstance(groups, str)
            or not isinstance(groups, Sequence)
            or not all(isinstance(g, str) and g for g in groups)
        ):
            raise PluginError("runtime resource 'hccl_groups' must be a sequence of HCCL comm names, one per stage")
        self.groups = tuple(groups)
        self._check_stages(len(self.groups), "afd.camp2p.hccl_groups")
        if self.num_attention % self.num_ffn:  # a2e/e2a pair FFN rank r with attention ranks r*g .. r*g+g-1
            raise ConfigError(
                "afd.num_ffn_ranks",
                f"camp2p serves A/F attention ranks per FFN rank: expected a divisor of "
                f"num_attention_ranks ({self.num_attention}), got {self.num_ffn}",
            )
        self.per_ffn = self.num_attention // self.num_ffn
        self.ops: OpSet = self._ops(
            typed,
            namespace=CAMP2P.namespace,
            known=CAMP2P.known,
            install_hint="build afd-plugin's Ascend ops (csrc/npu) and import its extension",
        )
        self.cam = CamP2POps.of(self.ops)

    @property
    def world_rank(self) -> int:
        """FFN ranks first (``0..F-1``), then attention."""
        return self.role_rank if self.role == FFN else self.num_ffn + self.role_rank

    def describe_world(self, world: int) -> str:
        if world < self.num_ffn:
            return f"FFN rank {world} (CAMP2P world rank {world})"
        return f"attention rank {world - self.num_ffn} (CAMP2P world rank {world})"

    def _state(self, item: WorkItem, batch_size: int) -> CAMP2PTransferState:
        return CAMP2PTransferState(
            item.layer_idx,
            item.stage_idx,
            select_group(item.stage_idx, self.groups),
            self.aiv_num,
            batch_size,
            self.model.hidden_size,
            self.model.topk,
            num_stages=item.num_stages,
        )

    def _a2e(
        self, stream: Stream, x: torch.Tensor, ids: object, scales: object, state: CAMP2PTransferState
    ) -> list[Any]:
        sizes = (state.batch_size, state.h, state.k, self.num_ffn, self.num_attention, self.world_rank)
        out: list[Any] = self.cam.a2e(stream, x, ids, scales, *sizes, state.group_ep, state.aiv_num, 0)
        return out

    def _e2a(self, stream: Stream, x: torch.Tensor, state: CAMP2PTransferState) -> torch.Tensor:
        sizes = (state.batch_size, state.h, state.k, self.num_ffn, self.num_attention, self.world_rank)
        out: torch.Tensor = self.cam.e2a(stream, x, state.atten_batch_size, *sizes, state.group_ep, state.aiv_num)
        return out


class CamP2PAttention(CamP2PConnector, CamAttentionBase):
    """Attention rank: recv = e2a of layer L-1, send = a2e of layer L."""

    recv_ops, send_ops = ("e2a",), ("a2e",)

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self._sent: PendingFifo[CAMP2PTransferState] = PendingFifo("camp2p attention a2e", limit=4 * len(self.groups))

    def _combine(self, stream: Stream, sent: CAMP2PTransferState) -> torch.Tensor:
        assert sent.reference is not None  # _dispatch set it before pushing the state
        out = self._e2a(stream, sent.reference, sent)
        self._check_stage_from(self.role_rank // self.per_ffn, sent.stage_id, f"the e2a rows of {sent.stage_id}")
        return out

    def _dispatch(self, work: Work, stream: Stream, outputs: torch.Tensor) -> None:
        item = work.item
        state = self._state(item, outputs.shape[0])
        state.reference = outputs
        self._stamp(state.stage_id)
        state.atten_batch_size = self._a2e(stream, outputs, None, None, state)[3]
        self._sent.push(item.stage_id, state)


class CamP2PFfn(CamP2PConnector, CamFfnBase):
    """FFN rank: recv = a2e, compute on the real rows, send = e2a."""

    recv_ops, send_ops = ("a2e",), ("e2a",)

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        typed = context.typed()
        assert isinstance(typed, FfnContext)  # this class is built for afd.role ffn only
        self.token_counts: Callable[[WorkItem], Sequence[int]] = typed.need(
            typed.stage_token_counts, "stage_token_counts"
        )
        self.ep_group: str | None = typed.ffn_ep_group
        # afd-plugin's FFN side hands a2e empty activations / expert ids / scales rather than None
        self._empty = torch.empty((0, self.model.hidden_size), dtype=self.model.dtype, device=self.device)
        self._empty_ids = torch.empty((0,), dtype=torch.int32, device=self.device)
        self._empty_scales = torch.empty((0,), dtype=torch.float32, device=self.device)
        #: observability: items that received zero tokens and sent e2a's one placeholder row
        self.stats = {"placeholders": 0}

    @hookimpl
    def on_recv(self, work: Work, stream: Stream) -> None:
        counts = list(self.token_counts(work.item))
        if len(counts) != self.num_attention:
            raise PluginError(
                f"camp2p: stage_token_counts gave {len(counts)} counts for {self.num_attention} attention ranks"
            )
        mine = counts[self.role_rank * self.per_ffn : (self.role_rank + 1) * self.per_ffn]
        state = self._state(work.item, max(1, sum(mine)))  # the operator needs at least one row
        out = self._a2e(stream, self._empty, self._empty_ids, self._empty_scales, state)
        expand_x, _ids, _scales, state.atten_batch_size, state.x_active_mask = out
        state.cam_p2p_ep_name, state.num_real = self.ep_group, sum(mine)
        for source in range(self.role_rank * self.per_ffn, (self.role_rank + 1) * self.per_ffn):
            self._check_stage_from(self.num_ffn + source, state.stage_id, f"the a2e rows of {state.stage_id}")
        work.transfer[TRANSFER] = state
        work.inputs.state = expand_x[: state.num_real]

    @hookimpl
    def on_compute(self, work: Work, compute: ComputeFn) -> None:
        state: CAMP2PTransferState = work.transfer[TRANSFER]
        out = compute(work.item, work.inputs.state)
        if out.shape != (state.num_real, self.model.hidden_size):
            raise PluginError(f"camp2p: FFN compute returned {tuple(out.shape)} for {state.num_real} tokens")
        if state.num_real != state.batch_size:  # zero tokens: e2a still sends its one placeholder row
            padded = out.new_zeros((state.batch_size, out.shape[1]))
            padded[: state.num_real] = out
            out = padded
            self.stats["placeholders"] += 1
        work.outputs.state = out

    @hookimpl
    def on_send(self, work: Work, stream: Stream) -> None:
        state: CAMP2PTransferState = work.transfer[TRANSFER]
        self._stamp(state.stage_id)
        self._e2a(stream, work.outputs.state, state)
