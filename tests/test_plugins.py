"""Plugin discovery through the ``afd_mrv2`` entry-point group, third parties included."""

from __future__ import annotations

import importlib
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from afd_mrv2.config import parse_afd_config
from afd_mrv2.devices import HostBackend
from afd_mrv2.errors import PluginError
from afd_mrv2.hooks.simlink import SimLinkConnector
from afd_mrv2.pipeline import Executor, WorkItem
from afd_mrv2.plugins import (
    AttentionContext,
    ConnectorContext,
    FfnContext,
    installed,
    load_plugins,
    plugins_for,
    role_context,
)

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
        load_plugins(FfnContext(config=config, source=lambda item: torch.zeros(1)))
    with pytest.warns(DeprecationWarning), pytest.raises(PluginError, match=r"'sink'.*provided: source"):
        load_plugins(config, resources={"source": lambda item: torch.zeros(1)})  # hook API 1's form
    context = ConnectorContext(config)
    with pytest.warns(DeprecationWarning), pytest.raises(PluginError, match="provided: none"):
        context.resource("process_group")


# ------------------------------------------------------------------ the typed context per role (hook API 2)


def _config(role: str, connector: str = "simlink"):
    return parse_afd_config({"connector": connector, "role": role})


def test_each_role_has_its_typed_context_and_a_wrong_one_is_refused() -> None:
    attention, ffn = _config("attention"), _config("ffn")
    assert AttentionContext(config=attention).role == "attention"
    assert FfnContext(config=ffn, follow_stages=True).follow_stages is True
    with pytest.raises(
        PluginError, match=r"AttentionContext is the context of the attention role, but afd.role is 'ffn'"
    ):
        AttentionContext(config=ffn)
    with pytest.raises(TypeError, match="attention_peers"):  # an FFN field is no Attention field
        AttentionContext(config=attention, attention_peers=[1])  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="sinc"):  # a misspelt object fails where it is built
        FfnContext(config=ffn, sinc=print)  # type: ignore[call-arg]


def test_role_context_builds_the_context_of_the_configs_role() -> None:
    context = role_context(_config("ffn", "torch_p2p"), model=1, attention_peers=[0], my_queue="q")
    assert isinstance(context, FfnContext)
    assert (context.model, context.attention_peers, dict(context.extras)) == (1, [0], {"my_queue": "q"})
    attention = role_context(_config("attention"), attention_peers=[0])  # not an Attention field: an extra
    assert isinstance(attention, AttentionContext) and dict(attention.extras) == {"attention_peers": [0]}
    assert context.typed() is context


def test_the_api1_names_stay_readable_with_a_deprecation_warning() -> None:
    def source(item: object) -> torch.Tensor:
        return torch.zeros(1)

    context = FfnContext(config=_config("ffn"), source=source, extras={"my_queue": "q"})
    with pytest.warns(DeprecationWarning, match=r"^ConnectorContext.resources is deprecated since hook API 2"):
        assert dict(context.resources) == {"source": source, "my_queue": "q"}
    with pytest.warns(DeprecationWarning, match=r"^ConnectorContext.resource\(name\) is deprecated since hook API 2"):
        assert context.resource("my_queue") == "q"
    with pytest.warns(
        DeprecationWarning, match=r"^ConnectorContext\(config, resources\) is deprecated since hook API 2"
    ):
        legacy = ConnectorContext(_config("ffn"), {"source": source, "follow_stages": True, "my_queue": "q"})
    typed = legacy.typed()
    assert isinstance(typed, FfnContext) and typed.source is source and typed.follow_stages is True
    assert dict(typed.extras) == {"my_queue": "q"}
    with pytest.raises(TypeError, match="not as resources"):
        load_plugins(typed, resources={"source": source})


def test_an_api1_connector_wrapping_a_built_in_one_runs_unchanged() -> None:
    """The pattern of API-1 plugins that wrap the owner's sink around a built-in connector: read the
    objects by name, replace one, hand the built-in a context of their own."""

    class TimesTen(SimLinkConnector):
        hook_api_version = 1

        def __init__(self, context: ConnectorContext) -> None:
            resources = dict(context.resources)
            sink = resources["sink"]
            resources["sink"] = lambda item, out: sink(item, out * 10)
            super().__init__(ConnectorContext(config=context.config, resources=resources))

    config = parse_afd_config(
        {"connector": "simlink", "role": "ffn", "connector_extra_config": {"latency_us": 0, "bandwidth_gbps": 0}}
    )
    outputs: dict[WorkItem, torch.Tensor] = {}
    context = FfnContext(config=config, source=lambda item: torch.full((2,), float(item.seq)), sink=outputs.__setitem__)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        connector = TimesTen(context)
    assert {str(w.message).split(" is deprecated")[0] for w in seen} == {
        "ConnectorContext.resources",
        "ConnectorContext(config, resources)",
    }
    items = [WorkItem(0, 0, seq) for seq in range(3)]
    with Executor(plugins_for(connector), HostBackend(), config.multistream, compute=lambda i, x: x + 1) as executor:
        executor.run(items)
    assert {i.seq: t.tolist() for i, t in outputs.items()} == {s: [(s + 1) * 10.0] * 2 for s in range(3)}
