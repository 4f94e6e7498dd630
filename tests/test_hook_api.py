"""The versioned hook API: frozen third-party plugins of API 0 and API 1, installed as a user would.

``tests/thirdparty/afd_echo_api0`` was written to the API before hook API 1 (``work.slot.state``,
``work.scratch``, one slot per item); ``afd_echo_api1`` to API 1 (``context.resource(name)``, which
hook API 2 deprecated for the typed context).  Both keep their send buffer apart from their receive
buffer and hold it across the send's wire time, so a slot freed too early shows up as wrong
outputs.  Each runs through the pipelined executor at depth >= 2 and its outputs are compared
exactly with the compute applied to the inputs; each warns only where it uses a deprecated member.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import pytest
import torch

import afd_mrv2
from afd_mrv2 import api
from afd_mrv2.config import parse_afd_config
from afd_mrv2.devices import HostBackend
from afd_mrv2.errors import PluginError
from afd_mrv2.items import WorkItem
from afd_mrv2.pipeline import Executor
from afd_mrv2.plugins import FfnContext, check_plugins, load_plugins
from afd_mrv2.work import Work
from tests.connectors import install_distribution

ITEMS = 24


def _inputs(item: WorkItem) -> torch.Tensor:
    return torch.full((4, 8), float(item.seq)) + torch.arange(8.0)


def _compute(item: WorkItem, x: torch.Tensor) -> torch.Tensor:
    return x * 2 + item.seq


def _run(
    connector: str, buffers: tuple[int, int], *, api0_lifetimes: bool | None = None, api1_owner: bool = False
) -> dict[int, torch.Tensor]:
    """``connector``'s outputs; ``api1_owner``: built the way an owner written to hook API 1 builds it."""
    config = parse_afd_config(
        {
            "connector": connector,
            "role": "ffn",
            "connector_extra_config": {"recv_delay_s": 0.0, "send_delay_s": 0.004},
            "multistream": {"enabled": True, "buffers": {"in": buffers[0], "out": buffers[1]}, "backend": "host"},
        }
    )
    outputs: dict[int, torch.Tensor] = {}
    objects = {"source": _inputs, "sink": lambda i, t: outputs.__setitem__(i.seq, t)}
    plugins = (
        load_plugins(config, resources=objects) if api1_owner else load_plugins(FfnContext(config=config, **objects))
    )
    executor = Executor(plugins, HostBackend(), config.multistream, compute=_compute, role="ffn")
    if api0_lifetimes is not None:
        executor._api0 = api0_lifetimes  # the negative control below: API 0's slot without its lifetime
    with executor:
        executor.run(WorkItem(0, 0, seq) for seq in range(ITEMS))
    return outputs


def _wrong(outputs: dict[int, torch.Tensor]) -> list[int]:
    assert sorted(outputs) == list(range(ITEMS))
    return [
        s for s, out in outputs.items() if not torch.equal(out, _compute(WorkItem(0, 0, s), _inputs(WorkItem(0, 0, s))))
    ]


def _installed_run(dist, connector, buffers, tmp_path, monkeypatch, caplog, *, api1_owner=False) -> set[str]:
    """Install ``dist``, run ``connector`` at ``buffers``, check every output is exact; the deprecation messages."""
    install_distribution(dist, tmp_path, monkeypatch)
    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.WARNING, "afd_mrv2"):
        warnings.simplefilter("always")
        outputs = _run(connector, buffers, api1_owner=api1_owner)
    assert _wrong(outputs) == []
    return {str(w.message) for w in seen if issubclass(w.category, DeprecationWarning)}


@pytest.mark.parametrize("buffers", [(2, 2), (2, 4), (1, 3), (3, 3)])
def test_an_api0_connector_runs_unchanged_with_its_old_lifetimes(tmp_path, monkeypatch, caplog, buffers):
    messages = _installed_run("afd_echo_api0", "echo_api0", buffers, tmp_path, monkeypatch, caplog)
    assert "work.slot is deprecated since hook API 1: use work.inputs and work.outputs (hook API 1)" in messages
    assert "work.scratch is deprecated since hook API 1: use work.transfer (hook API 1)" in messages
    assert "connector echo_api0 was written for hook API 0" in caplog.text


def test_api0_slots_aliased_without_their_lifetime_corrupt_outputs(tmp_path, monkeypatch):
    """Why the shim keeps API 0's lifetime, not only its name: with the input slot freed after
    compute (API 1), the next item on the slot overwrites the send buffer before it was sent."""
    install_distribution("afd_echo_api0", tmp_path, monkeypatch)
    monkeypatch.setattr(Work, "slot", property(lambda work: work.inputs))  # the alias alone
    assert _wrong(_run("echo_api0", (1, 3), api0_lifetimes=False)) != []


#: what an API-1 plugin that reads its runtime objects by name is told (the one member of API 1 it uses
#: that hook API 2 deprecated)
RESOURCE_DEPRECATED = (
    "ConnectorContext.resource(name) is deprecated since hook API 2: use the fields of AttentionContext / FfnContext"
)


@pytest.mark.parametrize("buffers", [(2, 2), (1, 3), (3, 3)])
def test_an_api1_connector_runs_unchanged_warned_only_where_api2_deprecated(tmp_path, monkeypatch, caplog, buffers):
    assert _installed_run("afd_echo_api1", "echo_api1", buffers, tmp_path, monkeypatch, caplog) == {RESOURCE_DEPRECATED}
    assert caplog.records == []  # no load-time line: nothing of API 1's buffer lifetimes changed


def test_an_api1_owner_and_an_api1_connector_run_unchanged(tmp_path, monkeypatch, caplog):
    """An owner still passing ``resources`` by name (hook API 1's ``load_plugins`` form) runs an API-1 plugin
    exactly as before: the owner's call and the plugin's reads each warn, nothing else."""
    messages = _installed_run("afd_echo_api1", "echo_api1", (2, 2), tmp_path, monkeypatch, caplog, api1_owner=True)
    assert messages == {
        RESOURCE_DEPRECATED,
        "load_plugins(config, resources=...) is deprecated since hook API 2: "
        "use load_plugins(AttentionContext(...) or FfnContext(...))",
    }
    assert caplog.records == []


def test_work_slot_is_refused_to_an_api1_plugin():
    work = Work(WorkItem(0, 0, 0), None, None, None)  # type: ignore[arg-type]
    with pytest.raises(AttributeError, match=r"Work.slot was removed in hook API 1: use work.inputs"):
        work.slot  # noqa: B018 - reading the removed attribute is what must raise


def _unserved(version: int, tmp_path, monkeypatch) -> None:
    install_distribution("afd_echo_api1", tmp_path, monkeypatch)
    import afd_echo_api1

    monkeypatch.setattr(afd_echo_api1.EchoLink, "hook_api_version", version)


@pytest.mark.parametrize("version", [api.HOOK_API_VERSION + 1, api.OLDEST_SERVED_HOOK_API - 1])
def test_an_unserved_api_version_is_refused_in_one_line_before_anything_is_built(tmp_path, monkeypatch, version):
    _unserved(version, tmp_path, monkeypatch)
    config = parse_afd_config({"connector": "echo_api1", "role": "ffn"})
    with pytest.raises(PluginError) as refused:
        check_plugins(config)
    message = str(refused.value)
    assert "\n" not in message
    assert f"connector 'echo_api1' (afd_echo_api1.EchoLink) was written for hook API {version}" in message
    assert f"serves hook API {api.OLDEST_SERVED_HOOK_API} to {api.HOOK_API_VERSION}" in message
    built = []
    with pytest.raises(PluginError, match="was written for hook API"):
        load_plugins(FfnContext(config=config, source=built.append, sink=built.append))


def test_the_embedded_run_refuses_an_unserved_plugin_before_any_rank_starts(tmp_path, monkeypatch):
    install_distribution("afd_echo_api1", tmp_path, monkeypatch)
    (tmp_path / "afd_echo_api1.py").write_text(
        (tmp_path / "afd_echo_api1.py").read_text().replace("hook_api_version = 1", "hook_api_version = 99")
    )
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "afd_mrv2.cli", "run", "--connector", "echo_api1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "connector 'echo_api1' (afd_echo_api1.EchoLink) was written for hook API 99" in last
    assert "starting" not in proc.stdout + proc.stderr  # no rank was started
    assert not out.exists()


def test_the_package_exports_exactly_the_declared_api():
    assert set(afd_mrv2.__all__) == set(api.__all__) | {"__version__"}
    for name in api.__all__:
        assert getattr(afd_mrv2, name) is getattr(api, name)
    major, minor, patch = (int(part) for part in afd_mrv2.__version__.split(".")[:3])
    assert (major, minor, patch) >= (0, 2, 0)
    assert api.HOOKS == ("create_streams", "on_recv", "on_compute", "on_send", "on_cleanup")
