"""``camasync``: the Ascend CAM async connector (``torch.ops.umdk_cam_op_lib``) as hooks.

Transfer state :class:`AFDAsyncTransferState`; slots :class:`CamAsyncRows`, :class:`CamAsyncFfnSend`.

See docs/internals/cam-connectors.md, "afd_mrv2.hooks.cam.camasync".
"""

from __future__ import annotations

from collections import defaultdict

import torch

from afd_mrv2.devices.base import Stream
from afd_mrv2.errors import ConfigError, PluginError
from afd_mrv2.hooks.cam.camasync_state import (
    CAMASYNC_OPS,
    AFDAsyncTransferState,
    CamAsyncDispatch,
    CamAsyncFfnBatch,
    CamAsyncFfnOutput,
    CamAsyncFfnSend,
    CamAsyncOps,
    CamAsyncRows,
)
from afd_mrv2.hooks.cam.common import TRANSFER, CamAttentionBase, CamConnectorBase, CamFfnBase, wait_until_idle
from afd_mrv2.hooks.cam.evidence import StreamBehaviour
from afd_mrv2.hooks.cam.ops import OperatorFamily, OpSet
from afd_mrv2.hooks.cam.options import CAMASYNC_MOVED, CamAsyncOptions, options
from afd_mrv2.hooks.cam.stage_tags import check_stage
from afd_mrv2.hookspecs import ComputeFn, hookimpl
from afd_mrv2.items import WorkItem
from afd_mrv2.plugins import ConnectorContext
from afd_mrv2.stages.pairing import PendingFifo
from afd_mrv2.topology import ATTENTION
from afd_mrv2.work import Work

_UNPROBED = (StreamBehaviour.UNVERIFIED, "closed-source operator library; run `afd-mrv2 probe npu`")
CAMASYNC = OperatorFamily("camasync", "umdk_cam_op_lib", CAMASYNC_OPS, dict.fromkeys(CAMASYNC_OPS, _UNPROBED))


class CamAsyncConnector(CamConnectorBase):
    """The entry point: builds :class:`CamAsyncAttention` or :class:`CamAsyncFfn` for ``afd.role``.

    Holds what both roles set up alike (options, sizes, operators).
    """

    name = CAMASYNC.name
    required_capability = "camasync"

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        config = self.config
        opts = options(config, CamAsyncOptions, CAMASYNC_MOVED)
        self.dynamic_quant = opts.dynamicQuant
        self.tp_size = opts.attn_ranks_per_dp
        self.comm_id = opts.comm_id
        self.max_seq_len = opts.max_seq_len
        if not config.async_mode:
            raise ConfigError(
                "afd.async", "CAMAsync carries its metadata in the CAM payload and needs async DP; expected true"
            )
        if not config.compute_gate_on_attention:
            raise ConfigError(
                "afd.compute_gate_on_attention", "CAMAsync dispatches routed tokens from attention; expected true"
            )
        self.stages = config.async_moe.stages
        self._check_stages(self.stages, "afd.async_moe.num_stages")
        self.world_size = self.num_attention + self.num_ffn
        self.expert_per_rank = -(-self.model.num_experts // self.num_ffn)
        typed = context.typed()
        self.group_name = typed.need(typed.cam_group, "cam_group")
        self.comm_args = torch.empty((1,), dtype=torch.float16, device=self.device)
        self._recv_placeholder = torch.empty((1,), dtype=self.model.dtype, device=self.device)
        self.ops: OpSet = self._ops(
            typed,
            namespace=CAMASYNC.namespace,
            known=CAMASYNC.known,
            install_hint="install the CAM run package and the umdk_cam_op_lib wheel, then import umdk_cam_op_lib",
        )
        self.cam = CamAsyncOps.of(self.ops)
        # An item is alive at most while it holds an input or an output buffer slot,
        # so at most inputs + outputs items are in flight per executor (depth
        # "auto" allocates, and may choose up to, the most of each).
        in_flight = sum(config.multistream.buffer_counts)
        #: how many transfers may be parked between items
        self.fifo_limit = 4 * self.stages * max(1, self.num_attention) * in_flight

    @property
    def world_rank(self) -> int:
        """Attention ranks first (``0..A-1``), then FFN."""
        return self.role_rank if self.role == ATTENTION else self.num_attention + self.role_rank

    def describe_world(self, world: int) -> str:
        if world < self.num_attention:
            return f"attention rank {world} (CAM world rank {world})"
        return f"FFN rank {world - self.num_attention} (CAM world rank {world})"

    def _common(self) -> tuple[int, int, int, int, int]:
        return self.num_ffn, self.num_attention, self.expert_per_rank, self.world_rank, self.world_size

    def _quant(self) -> tuple[int, int, str]:
        """The trailing ``tp_size, dynamic_quant, group_name`` of the dispatch operators."""
        return self.tp_size, self.dynamic_quant, self.group_name


class CamAsyncAttention(CamAsyncConnector, CamAttentionBase):
    """Attention rank: recv = async_combine_recv of (L-1, s), send = async_dispatch_send of (L, s)."""

    recv_ops, send_ops = ("async_combine_recv",), ("async_dispatch_send",)

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self._sent: PendingFifo[AFDAsyncTransferState] = PendingFifo(
            "camasync dispatches awaiting combine", limit=self.fifo_limit
        )

    def _combine(self, stream: Stream, sent: AFDAsyncTransferState) -> torch.Tensor:
        assert sent.reference is not None  # _dispatch set it before pushing the state
        placeholder = sent.reference.new_empty((1,))
        combined: torch.Tensor = self.cam.combine_recv(
            stream,
            placeholder,
            sent.topk_ids,
            sent.topk_weights,
            self.comm_args,
            self.comm_id,
            sent.batch_size,
            sent.hidden_size,
            sent.topk,
            *self._common(),
            self.group_name,
        )
        expected = WorkItem.stage(sent.layer_idx, sent.stage_idx, sent.num_stages)
        for ffn in range(self.num_ffn):  # every FFN rank answers every dispatch
            self._check_stage_from(self.num_attention + ffn, expected, f"the combine of {expected}")
        return combined

    def _dispatch(self, work: Work, stream: Stream, outputs: object) -> None:
        item, out = work.item, outputs
        if not isinstance(out, CamAsyncDispatch):
            raise PluginError(f"camasync: attention compute for layer {item.layer_idx} must return CamAsyncDispatch")
        batch, m = out.hidden_states.shape[0], self.model
        if batch > self.max_seq_len:
            raise PluginError(f"camasync: {batch} tokens exceed max_seq_len {self.max_seq_len}")
        for name, t in (("topk_ids", out.topk_ids), ("topk_weights", out.topk_weights)):
            if tuple(t.shape) != (batch, m.topk):
                raise PluginError(f"camasync: {name} shape must be ({batch}, {m.topk}), got {tuple(t.shape)}")
        state = AFDAsyncTransferState(
            batch_size=batch,
            hidden_size=m.hidden_size,
            topk=m.topk,
            layer_idx=item.layer_idx,
            stage_idx=item.stage_idx,
            num_stages=item.num_stages,
            source_rank=self.world_rank,
            topk_ids=out.topk_ids,
            topk_weights=out.topk_weights,
            reference=out.hidden_states,
        )
        self._sent.push(item.stage_id, state)
        sizes = (self.max_seq_len, batch, m.hidden_size, m.topk, *self._common(), item.layer_idx)
        self._stamp(item.stage_id)
        self.cam.dispatch_send(
            stream, out.hidden_states, out.topk_ids, self.comm_args, self.comm_id, *sizes, *self._quant()
        )


class CamAsyncFfn(CamAsyncConnector, CamFfnBase):
    """FFN rank: recv = async_dispatch_recv (parking early arrivals), send = async_combine_send."""

    recv_ops, send_ops = ("async_dispatch_recv",), ("async_combine_send",)

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self._arrived: PendingFifo[tuple[AFDAsyncTransferState, CamAsyncRows]] = PendingFifo(
            "camasync arrivals ahead of the schedule", limit=self.fifo_limit
        )
        self._ordinal: dict[tuple[int, int], int] = defaultdict(int)
        self._last_stage: dict[tuple[int, int], WorkItem] = {}  # (source, layer) -> its latest arrival's identity
        #: observability: arrivals parked ahead of the schedule, placeholder rows sent
        self.stats = {"parked": 0, "placeholders": 0}

    def _pending(self) -> tuple[PendingFifo[tuple[AFDAsyncTransferState, CamAsyncRows]], ...]:
        return (self._arrived,)

    def _receive(self, work: Work, stream: Stream) -> tuple[AFDAsyncTransferState, CamAsyncRows]:
        """One arrival: its transfer state and the rows it carried."""
        m = self.model
        sizes = (self.comm_id, self.max_seq_len, m.hidden_size, m.topk, *self._common())
        out = self.cam.dispatch_recv(stream, self._recv_placeholder, self.comm_args, *sizes, *self._quant())
        expand_x, shared, scales, scales_shared, header, expert_counts, shared_counts = out
        wait_until_idle(stream, work)
        batch, src, layer = (int(v) for v in header[:3].tolist())  # the connector's one host read
        routed, num_shared = int(expert_counts.sum().item()), int(shared_counts[0].item())
        if src < 0 or not 0 <= routed <= expand_x.shape[0] or not 0 <= num_shared <= shared.shape[0]:
            raise PluginError(
                f"camasync: dispatch_recv returned an inconsistent header {header.tolist()} ({routed} routed rows)"
            )
        stage = self._stage_of(src, layer)
        state = AFDAsyncTransferState(
            batch_size=self.max_seq_len,
            hidden_size=m.hidden_size,
            topk=m.topk,
            layer_idx=stage.layer_idx,
            stage_idx=stage.stage_idx,
            num_stages=stage.num_stages,
            source_rank=src,
            source_tokens=batch,
            num_routed=routed,
            num_shared=num_shared,
            token_nums_rankid_layeridx=header,
            expert_token_nums_shared=shared_counts,
            group_list=expert_counts,
            dynamic_scales=None if scales is None else scales[:routed],
            dynamic_scales_shared=None if scales_shared is None else scales_shared[:num_shared],
        )
        return state, CamAsyncRows(expand_x[:routed], shared[:num_shared])

    def _stage_of(self, src: int, layer: int) -> WorkItem:
        """The stage identity of the arrival just received from ``src`` for ``layer``.

        From the side channel when there is one (its layer must be the header's);
        else inferred from the arrival order (unchecked: assumes the source split
        its steps into this rank's stage count).
        """
        if self.stage_tags is None:
            ordinal = self._ordinal[(src, layer)]
            self._ordinal[(src, layer)] += 1
            return WorkItem.stage(layer, ordinal % self.stages, self.stages)
        tag = self.stage_tags.take(self.world_rank, src)
        if tag is not None and tag.layer_idx != layer:
            raise PluginError(
                f"camasync: {self.describe_world(self.world_rank)} received a dispatch of layer {layer} from "
                f"{self.describe_world(src)} whose side-channel stage identity is {tag}: "
                "the stage-tag side channel is out of step with the operators"
            )
        # CAM is FIFO per (source, destination, layer) and combine-send answers in that order, so one
        # source's stages of a layer must arrive in stage order: 0, 1, .. n-1, then the next step's 0
        last = self._last_stage.get((src, layer))
        if last is None or last.stage_idx == last.num_stages - 1:
            expected = WorkItem.stage(layer, 0, tag.num_stages if tag is not None else self.stages)
        else:
            expected = WorkItem.stage(layer, last.stage_idx + 1, last.num_stages)
        check_stage(
            tag,
            expected,
            connector=self.name,
            what=f"the next dispatch of layer {layer} from this source",
            sender_name=self.describe_world(src),
            receiver_name=self.describe_world(self.world_rank),
        )
        self._last_stage[(src, layer)] = expected
        return expected

    @hookimpl
    def on_recv(self, work: Work, stream: Stream) -> None:
        want = work.item.stage_id
        while True:
            arrival = self._arrived.pop_or_none(want)
            if arrival is None:
                work.raise_if_cancelled()
                arrival = self._receive(work, stream)
            state, rows = arrival
            if WorkItem.stage(state.layer_idx, state.stage_idx, state.num_stages) == want:
                if self.stage_tags is not None:  # an inferred identity is this rank's own guess: nothing to check
                    self._check_arrival(work, state)
                work.transfer[TRANSFER], work.inputs.state = state, rows
                return
            self._arrived.push(WorkItem.stage(state.layer_idx, state.stage_idx, state.num_stages), arrival)
            self.stats["parked"] += 1

    def _check_arrival(self, work: Work, state: AFDAsyncTransferState) -> None:
        """The arrival paired with ``work.item`` by (layer, stage) must also agree on the step's stage count."""
        check_stage(
            WorkItem.stage(state.layer_idx, state.stage_idx, state.num_stages),
            work.item.stage_id,
            connector=self.name,
            what="a dispatch",
            sender_name=self.describe_world(state.source_rank),
            receiver_name=self.describe_world(self.world_rank),
        )

    @hookimpl
    def on_compute(self, work: Work, compute: ComputeFn) -> None:
        s: AFDAsyncTransferState = work.transfer[TRANSFER]
        rows: CamAsyncRows = work.inputs.state
        quantized = rows.routed.dtype == torch.int8  # dynamicQuant: the scales go to compute with the rows
        if quantized and (s.dynamic_scales is None or s.dynamic_scales_shared is None):
            raise PluginError("camasync: int8 activations arrived without dynamic scales")
        assert s.group_list is not None  # on_recv's arrival state always carries it
        batch = CamAsyncFfnBatch(
            s.layer_idx,
            rows.routed,
            s.group_list[: self.expert_per_rank],
            rows.shared,
            s.dynamic_scales if quantized else None,
            s.dynamic_scales_shared if quantized else None,
        )
        out = compute(work.item, batch)
        if not isinstance(out, CamAsyncFfnOutput) or out.routed.shape[0] != s.num_routed:
            raise PluginError(f"camasync: FFN compute must return CamAsyncFfnOutput with {s.num_routed} routed rows")
        if out.shared is not None and out.shared.shape[0] != s.num_shared:
            raise PluginError(f"camasync: FFN compute returned {out.shared.shape[0]} shared rows for {s.num_shared}")
        if work.outputs.state is None:
            work.outputs.state = CamAsyncFfnSend()
        send: CamAsyncFfnSend = work.outputs.state
        routed = out.routed
        if s.num_routed == 0:  # CAM combine-send cannot take an empty routed result: one zero row instead
            if send.placeholder is None or send.placeholder.dtype != routed.dtype:
                send.placeholder = routed.new_zeros((1, s.hidden_size))
            routed = send.placeholder
            self.stats["placeholders"] += 1
        send.routed = routed
        send.shared = out.shared if out.shared is not None and s.num_shared else routed

    @hookimpl
    def on_send(self, work: Work, stream: Stream) -> None:
        s: AFDAsyncTransferState = work.transfer[TRANSFER]
        send: CamAsyncFfnSend = work.outputs.state
        sizes = (s.batch_size, s.hidden_size, s.topk, *self._common(), self.tp_size)
        header = s.token_nums_rankid_layeridx
        self._stamp(WorkItem.stage(s.layer_idx, s.stage_idx, s.num_stages))
        self.cam.combine_send(
            stream, send.routed, send.shared, self.comm_args, header, self.comm_id, *sizes, self.group_name
        )
