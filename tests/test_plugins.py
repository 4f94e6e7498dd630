"""Plugin discovery through the ``afd_mrv2`` entry-point group, third parties included."""

from __future__ import annotations

import importlib
import textwrap
from pathlib import Path

import pytest
import torch

from afd_mrv2.config import parse_afd_config
from afd_mrv2.devices import HostBackend
from afd_mrv2.errors import PluginError
from afd_mrv2.pipeline import Executor, WorkItem
from afd_mrv2.plugins import ConnectorContext, installed, load_plugins

THIRD_PARTY_MODULE = '''
"""A connector and an observer shipped by someone else."""
import torch
from afd_mrv2 import hookimpl

class EchoLink:
    """Receives ones scaled by seq, sends compute's result into a shared dict."""

    hook_api_version = 1
    outputs = {}

    def __init__(self, context):
        self.scale = context.config.extra.get("scale", 1.0)

    @hookimpl
    def on_recv(self, work):
        work.inputs.state = torch.ones(4) * work.item.seq * self.scale

    @hookimpl
    def on_compute(self, work, compute):
        work.outputs.state = compute(work.item, work.inputs.state)

    @hookimpl
    def on_send(self, work):
        EchoLink.outputs[work.item] = work.outputs.state


class CountingObserver:
    hook_api_version = 1
    counts = {}

    def __init__(self, context):
        self.role = context.config.role

    @hookimpl(wrapper=True)
    def on_compute(self, work):
        result = yield
        CountingObserver.counts[work.item] = CountingObserver.counts.get(work.item, 0) + 1
        return result
'''


def make_distribution(root: Path, name: str, module: str, source: str, entry_points: dict[str, str]) -> None:
    """A minimal installed distribution: a module plus its dist-info with entry points."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{name.replace('-', '_')}-0.1.dist-info"  # as installers name it
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[afd_mrv2]\n{lines}\n")


@pytest.fixture
def third_party(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    make_distribution(
        tmp_path,
        "afd-thirdparty-demo",
        "afd_thirdparty_demo",
        THIRD_PARTY_MODULE,
        {"tp_link": "afd_thirdparty_demo:EchoLink", "tp_watch": "afd_thirdparty_demo:CountingObserver"},
    )
    make_distribution(
        tmp_path,
        "afd-broken-demo",
        "afd_broken_demo",
        "raise ImportError('no such op')\n",
        {"tp_broken": "afd_broken_demo:X"},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return tmp_path


def test_third_party_connector_and_observer_run_end_to_end(third_party: Path) -> None:
    config = parse_afd_config(
        {
            "connector": "tp_link",
            "role": "ffn",
            "observers": ["tp_watch"],
            "connector_extra_config": {"scale": 2.0},
            "multistream": {"enabled": True, "depth": 2},
        }
    )
    plugins = load_plugins(config)
    assert plugins.connector_name == "tp_link" and list(plugins.observers) == ["tp_watch"]
    module = importlib.import_module("afd_thirdparty_demo")
    items = [WorkItem(0, s, i) for i, s in enumerate([0, 1] * 3)]
    with Executor(plugins, HostBackend(), config.multistream, compute=lambda item, x: x + 1) as executor:
        executor.run(items)
    assert {k: v.tolist() for k, v in module.EchoLink.outputs.items()} == {
        item: (torch.ones(4) * item.seq * 2.0 + 1).tolist() for item in items
    }
    assert module.CountingObserver.counts == dict.fromkeys(items, 1)


def test_installed_classifies_plugins_and_survives_a_broken_one(third_party: Path) -> None:
    found = installed()
    assert found["simlink"] == "connector"
    assert found["tp_link"] == "connector"
    assert found["tp_watch"] == "observer"
    assert found["tp_broken"].startswith("broken (ImportError: no such op")


def test_missing_connector_lists_installed_connectors(third_party: Path) -> None:
    config = parse_afd_config({"connector": "nccl_magic", "role": "ffn"})
    with pytest.raises(PluginError) as info:
        load_plugins(config)
    message = str(info.value)
    assert "connector 'nccl_magic' is not installed" in message
    connectors = [name for name, kind in installed().items() if kind == "connector"]
    assert {"simlink", "tp_link"} <= set(connectors)
    assert f"installed connectors: {', '.join(connectors)}" in message


def test_kind_mismatch_is_an_error(third_party: Path) -> None:
    with pytest.raises(PluginError, match="'tp_watch' is installed as observer, not as connector"):
        load_plugins(parse_afd_config({"connector": "tp_watch", "role": "ffn"}))
    with pytest.raises(PluginError, match="'tp_link' is installed as connector, not as observer"):
        load_plugins(parse_afd_config({"connector": "simlink", "role": "ffn", "observers": ["tp_link"]}))
    with pytest.raises(PluginError, match="failed to load"):
        load_plugins(parse_afd_config({"connector": "tp_broken", "role": "ffn"}))


def test_missing_resource_names_it_and_the_provided_ones() -> None:
    config = parse_afd_config({"connector": "simlink", "role": "ffn"})
    with pytest.raises(PluginError, match=r"needs the runtime resource 'sink'.*provided: source"):
        load_plugins(config, resources={"source": lambda item: torch.zeros(1)})
    context = ConnectorContext(config)
    with pytest.raises(PluginError, match="provided: none"):
        context.resource("process_group")
