"""The vllm.general_plugins entry point and register()."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
import threading

import pytest

from afd_mrv2 import vllm_plugin
from afd_mrv2.compat import CompatRefused
from afd_mrv2.errors import ConfigError, PluginError


def test_entry_point_is_installed() -> None:
    points = {ep.name: ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert points["afd_mrv2"].value == "afd_mrv2.vllm_plugin:register"
    assert points["afd_mrv2"].load() is vllm_plugin.register


def test_register_as_vllm_calls_it_twice_is_harmless() -> None:
    """Loaded like vllm.plugins.load_general_plugins does, in a fresh process: no arguments, twice."""
    code = (
        "import importlib.metadata, sys, threading\n"
        "ep = next(e for e in importlib.metadata.entry_points(group='vllm.general_plugins') if e.name == 'afd_mrv2')\n"
        "fn = ep.load(); n = threading.active_count()\n"
        "print(fn(), fn(), threading.active_count() == n, "
        "sorted(m for m in ('vllm', 'vllm_ascend', 'torch_npu', 'afd_mrv2.mrv2.attention.experts') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    if importlib.util.find_spec("vllm") is None:  # the unit-test venv: no runtime, not the MoE seam either
        assert out.stdout.strip() == "None None True []"
    else:  # .venv-vllm: the RoutedExperts replacement is registered (twice is harmless)
        assert out.stdout.strip() == "None None True ['afd_mrv2.mrv2.attention.experts', 'vllm']"


def test_no_afd_section_does_nothing() -> None:
    assert vllm_plugin.register({}) is None
    assert vllm_plugin.register({"other_plugin": {"x": 1}}) is None
    assert vllm_plugin.validate("not-a-mapping") is None


@pytest.mark.parametrize(
    ("afd", "error", "key"),
    [
        ({"role": "attention"}, ConfigError, "afd.connector"),
        ({"connector": "simlink", "role": "attention", "port": 0}, ConfigError, "afd.port"),
        ({"connector": "simlink", "role": "attention", "unknown": 1}, ConfigError, "afd.unknown"),
        ({"connector": "missing", "role": "attention"}, PluginError, "afd.connector"),
    ],
)
def test_bad_afd_config_raises_before_anything_else(afd, error, key, monkeypatch) -> None:
    def no_decision(required):
        raise AssertionError("the compat gate ran before the config was validated")

    threads = threading.active_count()
    with pytest.raises(error) as info:
        vllm_plugin.validate({"afd": afd}, gate=no_decision)
    assert str(info.value).startswith(key)
    with pytest.raises(error):
        vllm_plugin.register({"afd": afd})
    assert threading.active_count() == threads


def test_valid_config_on_a_refused_runtime_is_refused_clearly() -> None:
    """A runtime without vLLM (faked, whatever this machine has): a valid afd section is refused with the pairs listed."""
    from afd_mrv2.compat import decide, detect_runtime

    asked: list[tuple[str, ...]] = []

    def no_vllm(require: tuple[str, ...]):  # type: ignore[no-untyped-def]
        asked.append(require)
        runtime = detect_runtime({"torch": "2.13.0"}.get, python="3.12.4", cann_files=[])
        return decide(runtime, require=require, env={})

    with pytest.raises(CompatRefused) as info:
        vllm_plugin.validate({"afd": {"connector": "simlink", "role": "attention"}}, gate=no_vllm)
    text = str(info.value)
    assert "vLLM is not installed" in text and "cuda-vllm-0.33.0" in text
    assert len(asked) == 1 and "moe_seam" in asked[0]  # the gate decided, on what the config requires


def test_required_capabilities_follow_the_config() -> None:
    from afd_mrv2.config import parse_afd_config

    plain = parse_afd_config({"connector": "simlink", "role": "attention"})
    assert vllm_plugin.required_capabilities(plain) == ("moe_seam",)  # the vLLM path needs the MoE seam
    assert vllm_plugin.required_capabilities(plain, v2_runner=True) == ("moe_seam", "mrv2")  # mrv2 only on V2
    ffn = parse_afd_config(
        {"connector": "camp2p", "role": "ffn", "compute_gate_on_attention": False, "multistream": {"enabled": True}}
    )
    assert vllm_plugin.required_capabilities(ffn) == ("moe_seam", "multistream_ffn", "camp2p")


THIRD_PARTY_CONNECTORS = """
from afd_mrv2 import hookimpl

class FabricLink:
    hook_api_version = 1
    required_capability = "camasync"  # needs what the runtime pair grants CAMAsync

    def __init__(self, context):
        pass

    @hookimpl
    def on_recv(self, work): ...

    @hookimpl
    def on_compute(self, work, compute): ...

    @hookimpl
    def on_send(self, work): ...


class PlainLink(FabricLink):
    required_capability = None
"""


def test_a_third_party_connector_gets_the_capability_it_declares(tmp_path, monkeypatch) -> None:
    import importlib

    from afd_mrv2.compat import V2_RUNNER_ENV
    from afd_mrv2.config import parse_afd_config
    from tests.test_plugins import make_distribution

    points = {"tp_fabric": "afd_tp_caps:FabricLink", "tp_plain": "afd_tp_caps:PlainLink"}
    make_distribution(tmp_path, "afd-tp-caps", "afd_tp_caps", THIRD_PARTY_CONNECTORS, points)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    fabric = parse_afd_config({"connector": "tp_fabric", "role": "attention"})
    assert vllm_plugin.required_capabilities(fabric) == ("moe_seam", "camasync")
    plain = parse_afd_config({"connector": "tp_plain", "role": "ffn"})
    assert vllm_plugin.required_capabilities(plain) == ("moe_seam",)
    from afd_mrv2.compat import decide, detect_runtime

    asked: list[tuple[str, ...]] = []

    def gate(require: tuple[str, ...]):  # type: ignore[no-untyped-def]
        asked.append(require)
        return decide(detect_runtime({"torch": "2.13.0"}.get, python="3.12.4", cann_files=[]), require=require, env={})

    monkeypatch.delenv(V2_RUNNER_ENV, raising=False)
    with pytest.raises(CompatRefused):
        vllm_plugin.validate({"afd": {"connector": "tp_fabric", "role": "attention"}}, gate=gate)
    assert asked == [("moe_seam", "camasync")]  # validate asks the gate for the declared capability
    monkeypatch.setenv(V2_RUNNER_ENV, "1")  # the V2 runner selected: mrv2 too
    with pytest.raises(CompatRefused):
        vllm_plugin.validate({"afd": {"connector": "tp_fabric", "role": "attention"}}, gate=gate)
    assert asked[-1] == ("moe_seam", "mrv2", "camasync")
