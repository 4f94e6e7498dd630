"""Operator resolution, capabilities from evidence, and the fence (the evidence file: test_evidence.py)."""

from __future__ import annotations

import pytest
import torch

from afd_mrv2.errors import PluginError
from afd_mrv2.hooks.cam.evidence import Evidence, OpEvidence, StreamBehaviour
from afd_mrv2.hooks.cam.ops import BoundOp, OpCapability, resolve_torch_ops, torch_opset

_LIB = torch.library.Library("afd_mrv2_fake_ops", "DEF")
_LIB.define("echo(Tensor x) -> Tensor")
_LIB.impl("echo", lambda x: x * 2, "CompositeExplicitAutograd")

KNOWN = {"echo": (StreamBehaviour.CURRENT, "read the source")}


def test_resolution_checks_the_dispatcher_once() -> None:
    found = resolve_torch_ops("afd_mrv2_fake_ops", ["echo", "missing"])
    assert found["missing"] is None
    assert torch.equal(found["echo"](torch.ones(2)), torch.full((2,), 2.0))


def test_torch_opset_uses_known_behaviour_without_evidence() -> None:
    ops = torch_opset("afd_mrv2_fake_ops", KNOWN, evidence=None, environment={}, install_hint="n/a")
    cap = ops["echo"].capability
    assert (cap.qualname, cap.stream, cap.basis) == (
        "afd_mrv2_fake_ops.echo",
        StreamBehaviour.CURRENT,
        "read the source",
    )
    assert ops.source == "torch.ops.afd_mrv2_fake_ops"
    ops.check_start_up(["echo"], [], connector="x", pipelined=True)


def test_evidence_applies_only_to_its_environment() -> None:
    evidence = Evidence(
        {"torch_npu": "2.10.0"},
        {
            "afd_mrv2_fake_ops.echo": OpEvidence(
                "afd_mrv2_fake_ops.echo", True, StreamBehaviour.UNVERIFIED, detail="inconclusive"
            )
        },
    )
    same = torch_opset(
        "afd_mrv2_fake_ops", KNOWN, evidence=evidence, environment={"torch_npu": "2.10.0"}, install_hint=""
    )
    assert same["echo"].capability.stream is StreamBehaviour.UNVERIFIED
    assert "probe evidence: inconclusive" in same["echo"].capability.basis
    other = torch_opset(
        "afd_mrv2_fake_ops", KNOWN, evidence=evidence, environment={"torch_npu": "2.11.0"}, install_hint=""
    )
    assert other["echo"].capability.stream is StreamBehaviour.CURRENT
    assert "evidence ignored" in other["echo"].capability.basis


def test_foreign_on_a_machine_without_accelerator_is_refused() -> None:
    evidence = Evidence(
        {}, {"afd_mrv2_fake_ops.echo": OpEvidence("afd_mrv2_fake_ops.echo", True, StreamBehaviour.FOREIGN, "default")}
    )
    with pytest.raises(PluginError, match="no accelerator is available"):
        torch_opset("afd_mrv2_fake_ops", KNOWN, evidence=evidence, environment={}, install_hint="")


def test_missing_operator_names_the_install_hint() -> None:
    with pytest.raises(PluginError, match=r"afd_mrv2_fake_ops\.nope; install it"):
        torch_opset(
            "afd_mrv2_fake_ops", {"nope": KNOWN["echo"]}, evidence=None, environment={}, install_hint="install it"
        )


class Home:
    name = "home"

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def wait_for_caller(self, caller) -> None:
        self.log.append(f"home waits {caller}")

    def make_caller_wait(self, caller) -> None:
        self.log.append(f"{caller} waits home")


def test_bound_op_fences_only_foreign_operators() -> None:
    log: list[str] = []
    foreign = BoundOp(
        OpCapability("ns.f", True, StreamBehaviour.FOREIGN, "probe"), lambda x: log.append(f"op {x}") or x, Home(log)
    )
    assert foreign("recv", 7) == 7
    assert log == ["home waits recv", "op 7", "recv waits home"]
    assert (foreign.calls, foreign.fenced_calls) == (1, 1)
    current = BoundOp(OpCapability("ns.c", True, StreamBehaviour.CURRENT, "src"), lambda: 1, Home(log))
    assert current("recv") == 1 and current.home is None and current.fenced_calls == 0
    with pytest.raises(PluginError, match="no home stream is known"):
        BoundOp(OpCapability("ns.f", True, StreamBehaviour.FOREIGN, "probe"), lambda: 1)


class _Native:
    def __init__(self, busy: int) -> None:
        self.busy = busy

    def query(self) -> bool:
        self.busy -= 1
        return self.busy < 0


class _Stream:
    def __init__(self, native) -> None:
        self.native = native


def test_host_reads_poll_the_stream_and_honour_cancellation() -> None:
    import threading

    from afd_mrv2.errors import PipelineAborted
    from afd_mrv2.hooks.cam.common import wait_until_idle
    from afd_mrv2.items import WorkItem
    from afd_mrv2.work import INPUT, OUTPUT, BufferSlot, Work

    cancel = threading.Event()
    slots = (BufferSlot(INPUT, 0, None, None), BufferSlot(OUTPUT, 0, None, None))  # events unused here
    work = Work(WorkItem(0, 0, 0), *slots, cancel)
    native = _Native(busy=3)
    wait_until_idle(_Stream(native), work, poll_s=0)
    assert native.busy == -1  # polled until idle
    wait_until_idle(_Stream(None), work)  # CPU backends: nothing to wait for
    cancel.set()
    with pytest.raises(PipelineAborted):
        wait_until_idle(_Stream(_Native(busy=10**9)), work, poll_s=0)


def test_installed_versions_name_torch_and_only_installed_distributions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decided from a controlled environment: the metadata lookup sees only the distributions named here."""
    from importlib import metadata

    from afd_mrv2.hooks.cam.ops import EVIDENCE_DISTRIBUTIONS, installed_versions

    installed = {"torch_npu": "2.10.0.post1", "pluggy": "9.9.9"}

    def version(name: str) -> str:
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(metadata, "version", version)
    assert "umdk_cam_op_lib" in EVIDENCE_DISTRIBUTIONS and "torch_npu" in EVIDENCE_DISTRIBUTIONS
    versions = installed_versions()
    assert versions["torch"] == torch.__version__
    assert versions["torch_npu"] == "2.10.0.post1"
    assert "umdk_cam_op_lib" not in versions  # not installed: evidence from a machine that has it cannot apply
    assert installed_versions("pluggy") == {"torch": torch.__version__, "pluggy": "9.9.9"}
    installed["umdk_cam_op_lib"] = "1.2.0"  # where it is installed, it is named
    assert installed_versions()["umdk_cam_op_lib"] == "1.2.0"
