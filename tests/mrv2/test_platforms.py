"""The platform adapters of the vLLM integration, without vLLM: their tables and the worker's install hook
(every upstream name their source imports is a declared seam: tests/compat/test_contracts.py; vllm-ascend's
own code runs them on the CPU vehicle, tests/ascend_vehicle/test_adapters.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from afd_mrv2.mrv2.attention.worker import afd_init_device_worker_class
from afd_mrv2.mrv2.platforms.attention import ATTENTION_ADAPTERS, attention_adapter
from afd_mrv2.mrv2.platforms.ffn import FFN_ADAPTERS, ffn_adapter

ROOT = Path(__file__).resolve().parents[2]
PLATFORMS = ROOT / "afd_mrv2" / "mrv2" / "platforms"


def test_the_tables_name_ascend_only() -> None:
    assert set(ATTENTION_ADAPTERS) == set(FFN_ADAPTERS) == {"ascend"}
    assert attention_adapter("cpu") is None and attention_adapter("cuda") is None
    assert ffn_adapter("cpu") is None and ffn_adapter("cuda") is None


class _Worker:
    """Stands in for a platform worker: its ``__init__`` is where NPUWorker registers its ops."""

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self.registered = True

    def init_device(self) -> None:
        pass


class _Config:
    def __init__(self, additional_config: dict[str, Any]) -> None:
        self.additional_config = additional_config


class _Adapter:
    def __init__(self) -> None:
        self.installs: list[bool] = []
        self.worker: _Worker | None = None

    def install_attention_layer(self) -> str:
        self.installs.append(self.worker is not None and self.worker.registered)
        return "installed"


@pytest.mark.parametrize(
    ("additional", "installs"),
    [({"afd": {"role": "attention"}}, 1), ({"afd": {"role": "ffn"}}, 0), ({}, 0)],
    ids=["attention", "ffn", "no-afd"],
)
def test_the_worker_installs_the_platform_layer_after_its_init_on_the_attention_role_only(
    additional: dict[str, Any], installs: int
) -> None:
    adapter = _Adapter()

    class Base(_Worker):
        def __init__(self, vllm_config: Any) -> None:
            super().__init__(vllm_config)
            adapter.worker = self  # the platform registered its ops: the adapter may now replace

    cls = afd_init_device_worker_class(Base, lambda: pytest.fail("no upstream needed"), adapter=adapter)
    worker = cls(_Config(additional))
    assert isinstance(worker, Base) and adapter.installs == [True] * installs


def test_without_an_adapter_the_worker_keeps_the_platforms_init() -> None:
    cls = afd_init_device_worker_class(_Worker, lambda: pytest.fail("no upstream needed"))
    assert "__init__" not in vars(cls)
