"""The Ascend connectors' ``afd.connector_extra_config``, declared for the one config parser.

Each connector's options are a frozen dataclass parsed by
:func:`afd_mrv2.config.parse_section`: unknown keys, types and ranges are
refused there, before any operator is resolved, with the config module's
one-line errors (``afd.connector_extra_config.dynamicQuant: expected an
integer in 0..1, got 2 (int)``).  ``stream_evidence`` is accepted by both and
read by :func:`afd_mrv2.hooks.cam.ops.load_evidence`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from afd_mrv2.config import AfdConfig
from afd_mrv2.options import ANYTHING, integer, option, parse_section
from afd_mrv2.topology import ATTENTION

KEY = "afd.connector_extra_config"

OptionsT = TypeVar("OptionsT", bound="CamOptions")


@dataclass(frozen=True)
class CamOptions:
    """What both Ascend connectors accept."""

    stream_evidence: Any = option(ANYTHING, None)  # the ``afd-mrv2 probe npu`` evidence (see ops.load_evidence)


@dataclass(frozen=True)
class CamP2POptions(CamOptions):
    """camp2p: AIV cores per operator (``core_num``, overridden per role by
    ``attn_core_num`` / ``ffn_core_num``) and ``quant_mode`` (0 only)."""

    core_num: int = option(integer(1, 64), 8)
    attn_core_num: int | None = option(integer(1, 64), None)
    ffn_core_num: int | None = option(integer(1, 64), None)
    quant_mode: int = option(integer(0, 0, why="CAMP2P supports only quant_mode 0"), 0)

    def core_num_for(self, role: str) -> int:
        """The AIV core count of ``role``: its per-role option when set, else ``core_num``."""
        per_role = self.attn_core_num if role == ATTENTION else self.ffn_core_num
        return self.core_num if per_role is None else per_role


@dataclass(frozen=True)
class CamAsyncOptions(CamOptions):
    """camasync: ``dynamicQuant`` (0|1), ``attn_ranks_per_dp`` (CAM's TP width),
    ``comm_id``, ``max_seq_len`` (tokens per dispatch, the FFN side's capacity)."""

    dynamicQuant: int = option(integer(0, 1), 0)
    attn_ranks_per_dp: int = option(integer(1, 1 << 10), 1)
    comm_id: int = option(integer(0, 1 << 16), 0)
    max_seq_len: int = option(integer(1, 1 << 24), 8192)


#: afd-plugin's async-MoE options, now the ``afd.async_moe`` section: refused with a pointer there.
CAMASYNC_MOVED = {k: "afd.async_moe" for k in ("async_moe_ubatching", "async_moe_num_ubatches", "async_moe_split")}


def options(config: AfdConfig, kind: type[OptionsT], moved: Mapping[str, str] | None = None) -> OptionsT:
    """Parse ``config.extra`` into ``kind``; keys listed in ``moved`` get a pointer to their new home."""
    return parse_section(kind, config.extra, KEY, moved=moved)
