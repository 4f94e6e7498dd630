"""The typed ``afd`` / ``afd.multistream`` configuration and the one options parser: defaults, errors, fuzzing."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_mrv2.config import MultistreamConfig, PlacementConfig, parse_afd_config, parse_multistream
from afd_mrv2.errors import ConfigError
from afd_mrv2.hooks.cam.options import CamAsyncOptions, CamP2POptions
from afd_mrv2.hooks.p2p import P2pOptions, parse_options
from afd_mrv2.hooks.simlink import LinkModel, SimLinkOptions
from afd_mrv2.options import TEXT, accepted_keys, integer, number, one_of, option, parse_section
from afd_mrv2.placement import Placement


def test_defaults_are_the_serialized_fallback() -> None:
    config = parse_multistream(None)
    assert config == MultistreamConfig()
    assert config.enabled is False and config.depth == 2
    assert not config.active_for("ffn")


def test_valid_section_round_trips_and_is_hashable() -> None:
    config = parse_multistream(
        {
            "enabled": True,
            "depth": 4,
            "roles": ["attention", "ffn"],
            "phases": ["send"],
            "backend": "host",
            "trace": True,
        }
    )
    assert config.depth == 4 and config.phases == ("send",) and config.roles == ("attention", "ffn")
    assert config.active_for("attention") and config.active_for("ffn")
    hash(config)


def test_depth_auto() -> None:
    config = parse_multistream({"enabled": True, "depth": "auto", "auto_window": 12})
    assert config.auto_depth and config.slots == 8 and config.auto_window == 12
    assert parse_multistream({"depth": 3}).slots == 3 and not parse_multistream({"depth": 3}).auto_depth
    with pytest.raises(ConfigError, match=r'expected an integer in 1\.\.8 or "auto", got 9'):
        parse_multistream({"depth": 9})


def test_afd_section_parses_upstream_keys() -> None:
    config = parse_afd_config(
        {
            "connector": "simlink",
            "role": "ffn",
            "num_attention_ranks": 4,
            "num_ffn_ranks": 2,
            "async": True,
            "connector_extra_config": {"latency_us": 10, "nested": {"a": [1, 2]}},
            "multistream": {"enabled": True},
        }
    )
    assert config.async_mode is True and config.num_attention_ranks == 4
    assert config.extra == {"latency_us": 10, "nested": {"a": [1, 2]}}
    hash(config)


@pytest.mark.parametrize(("attention", "ffn"), [(3, 2), (2, 3), (1, 2), (1, 1), (4, 2)])
def test_afd_section_accepts_free_topologies(attention: int, ffn: int) -> None:
    """Attention and FFN rank counts are independent: F need not divide A nor be <= it."""
    base = {"connector": "x", "num_attention_ranks": attention, "num_ffn_ranks": ffn}
    for role, count in (("attention", attention), ("ffn", ffn)):
        for rank in range(count):
            config = parse_afd_config({**base, "role": role, "rank": rank})
            assert (config.num_attention_ranks, config.num_ffn_ranks, config.rank) == (attention, ffn, rank)
        with pytest.raises(ConfigError, match=rf"^afd\.rank: expected an integer in 0\.\.{count - 1} "):
            parse_afd_config({**base, "role": role, "rank": count})


# (section, expected key named in the error)
MALFORMED_MULTISTREAM = [
    ({"depth": 0}, "afd.multistream.depth"),
    ({"depth": 9}, "afd.multistream.depth"),
    ({"depth": "2"}, "afd.multistream.depth"),
    ({"depth": True}, "afd.multistream.depth"),
    ({"depth": 2.0}, "afd.multistream.depth"),
    ({"depth": "Auto"}, "afd.multistream.depth"),
    ({"auto_window": 0}, "afd.multistream.auto_window"),
    ({"enabled": "yes"}, "afd.multistream.enabled"),
    ({"enabled": 1}, "afd.multistream.enabled"),
    ({"roles": "ffn"}, "afd.multistream.roles"),
    ({"roles": []}, "afd.multistream.roles"),
    ({"roles": ["ffn", "ffn"]}, "afd.multistream.roles"),
    ({"roles": ["expert"]}, "afd.multistream.roles"),
    ({"phases": ["compute"]}, "afd.multistream.phases"),
    ({"phases": []}, "afd.multistream.phases"),
    ({"backend": "cuda"}, "afd.multistream.backend"),
    ({"close_timeout_s": 0}, "afd.multistream.close_timeout_s"),
    ({"close_timeout_s": float("nan")}, "afd.multistream.close_timeout_s"),
    ({"close_timeout_s": -1}, "afd.multistream.close_timeout_s"),
    ({"trace": None}, "afd.multistream.trace"),
    ({"dpeth": 2}, "afd.multistream.dpeth"),
    ({"is_multistream": True}, "afd.multistream.is_multistream"),
]


@pytest.mark.parametrize(("section", "key"), MALFORMED_MULTISTREAM)
def test_malformed_multistream_gives_one_line_naming_the_key(section: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_multistream(section)
    message = str(info.value)
    assert info.value.key == key
    assert message.startswith(key + ":")
    assert "\n" not in message
    assert "expected" in message or "accepted" in message


def test_unknown_key_lists_the_accepted_ones() -> None:
    with pytest.raises(
        ConfigError,
        match="accepted keys: auto_window, backend, buffers, close_timeout_s, depth, enabled, phases, roles, trace",
    ):
        parse_multistream({"depht": 3})


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"role": "ffn"}, "afd.connector"),
        ({"connector": "x"}, "afd.role"),
        ({"connector": "x", "role": "expert"}, "afd.role"),
        ({"connector": "", "role": "ffn"}, "afd.connector"),
        ({"connector": "x", "role": "ffn", "num_ffn_ranks": 0}, "afd.num_ffn_ranks"),
        ({"connector": "x", "role": "attention", "num_attention_ranks": 0}, "afd.num_attention_ranks"),
        ({"connector": "x", "role": "ffn", "num_attention_ranks": 3, "num_ffn_ranks": 2, "rank": 2}, "afd.rank"),
        ({"connector": "x", "role": "ffn", "port": 70000}, "afd.port"),
        ({"connector": "x", "role": "ffn", "observers": "trace"}, "afd.observers"),
        ({"connector": "x", "role": "ffn", "connector_extra_config": [1]}, "afd.connector_extra_config"),
        ({"connector": "x", "role": "ffn", "connector_extra_config": {"f": object()}}, "afd.connector_extra_config.f"),
        ({"connector": "x", "role": "ffn", "multistream": []}, "afd.multistream"),
        ({"connector": "x", "role": "ffn", "multistream": {"depth": -1}}, "afd.multistream.depth"),
    ],
)
def test_malformed_afd_section(section: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_afd_config(section)
    assert info.value.key == key
    assert "\n" not in str(info.value)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 12) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
multistream_keys = st.sampled_from(
    ["enabled", "depth", "auto_window", "roles", "phases", "backend", "close_timeout_s", "trace", "x"]
)
values = json_values | st.sampled_from(
    ["ffn", "attention", "recv", "send", "host", "auto", ["ffn"], ["recv", "send"], 3]
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(multistream_keys, values, max_size=6) | json_values)
def test_fuzzed_multistream_only_raises_config_error(raw: object) -> None:
    try:
        config = parse_multistream(raw)
    except ConfigError as exc:
        assert "\n" not in str(exc) and exc.key.startswith("afd.multistream")
    else:
        assert 1 <= config.slots <= 8
        hash(config)


afd_keys = st.sampled_from(
    [
        "connector",
        "role",
        "num_attention_ranks",
        "num_ffn_ranks",
        "port",
        "observers",
        "async",
        "multistream",
        "placement",
        "zz",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(afd_keys, values | st.dictionaries(multistream_keys, values, max_size=3), max_size=6))
def test_fuzzed_afd_section_only_raises_config_error(raw: dict) -> None:
    try:
        parse_afd_config(raw)
    except ConfigError as exc:
        assert "\n" not in str(exc) and exc.key.startswith("afd")


# ----------------------------------------------------------------- the one options parser


@dataclass(frozen=True)
class _Demo:
    name: str = option(TEXT)
    size: int = option(integer(1, 4), 2)
    limit: float | None = option(number(), None)
    mode: str = option(one_of(("a", "b")), "a", key="class")


def test_parse_section_derives_keys_defaults_and_requirements_from_the_fields() -> None:
    assert parse_section(_Demo, {"name": "x"}, "demo") == _Demo(name="x", size=2, limit=None, mode="a")
    assert parse_section(_Demo, {"name": "x", "limit": None, "class": "b"}, "demo").mode == "b"
    assert accepted_keys(_Demo).keys() == {"name", "size", "limit", "class"}
    with pytest.raises(ConfigError, match=r"^demo\.name: required key is missing$"):
        parse_section(_Demo, {}, "demo")
    with pytest.raises(ConfigError, match=r"^demo\.mode: unknown key; accepted keys: class, limit, name, size$"):
        parse_section(_Demo, {"name": "x", "mode": "a"}, "demo")
    with pytest.raises(ConfigError, match=r"^demo\.size: expected an integer in 1\.\.4, got 5 \(int\)$"):
        parse_section(_Demo, {"name": "x", "size": 5}, "demo")
    with pytest.raises(ConfigError, match=r"^demo\.old: not a connector option in afd-mrv2; use demo\.name$"):
        parse_section(_Demo, {"old": 1}, "demo", moved={"old": "demo.name"})


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"close_timeout_s": 10**400}, "afd.multistream.close_timeout_s: expected a number > 0 and <= 3600, got"),
        ({"close_timeout_s": float("inf")}, "afd.multistream.close_timeout_s: expected a number > 0 and <= 3600"),
        ({"roles": [["ffn"]]}, "afd.multistream.roles: expected a non-empty list of distinct values from"),
    ],
)
def test_edge_values_are_refused_with_one_line(section: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_multistream(section)
    assert str(info.value).startswith(message)


def test_connector_options_name_the_key_and_the_accepted_values() -> None:
    key = "afd.connector_extra_config"
    with pytest.raises(
        ConfigError, match=rf"^{key}\.recv_timeout: unknown key; accepted keys: max_tokens, quant, recv_"
    ):
        parse_options({"recv_timeout": 1})
    with pytest.raises(ConfigError, match=rf"^{key}\.latency_us: expected a number >= 0, got -1 \(int\)$"):
        LinkModel.from_options({"latency_us": -1})
    opts = parse_section(CamP2POptions, {"core_num": 4, "ffn_core_num": 2}, key)
    assert opts.core_num_for("attention") == 4 and opts.core_num_for("ffn") == 2
    with pytest.raises(ConfigError, match=r"quant_mode: expected 0 \(CAMP2P supports only quant_mode 0\), got 1"):
        parse_section(CamP2POptions, {"quant_mode": 1}, key)


CONNECTOR_OPTIONS = [P2pOptions, SimLinkOptions, CamP2POptions, CamAsyncOptions]
option_keys = st.sampled_from(sorted({k for kind in CONNECTOR_OPTIONS for k in accepted_keys(kind)} | {"x"}))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(CONNECTOR_OPTIONS), st.dictionaries(option_keys, values, max_size=5) | json_values)
def test_fuzzed_connector_options_only_raise_config_error(kind: type, raw: object) -> None:
    try:
        parse_section(kind, raw, "afd.connector_extra_config")
    except ConfigError as exc:
        assert "\n" not in str(exc) and exc.key.startswith("afd.connector_extra_config")


def test_expert_replicas_and_rendezvous() -> None:
    config = parse_afd_config({"connector": "torch_p2p", "role": "ffn", "num_ffn_ranks": 3, "expert_replicas": 2})
    assert config.expert_replicas == 2 and config.rendezvous == "ffn0"
    with pytest.raises(
        ConfigError, match=r"^afd\.expert_replicas: expected an integer in 1\.\.3 \(num_ffn_ranks\), got 4$"
    ):
        parse_afd_config({"connector": "torch_p2p", "role": "ffn", "num_ffn_ranks": 3, "expert_replicas": 4})
    assert parse_afd_config({"connector": "x", "role": "attention", "rendezvous": "external"}).rendezvous == "external"
    with pytest.raises(ConfigError, match=r"^afd\.rendezvous: "):
        parse_afd_config({"connector": "x", "role": "attention", "rendezvous": "serve"})


# ----------------------------------------------------------------- afd.placement


FFN2 = {"connector": "torch_p2p", "role": "ffn", "num_ffn_ranks": 2}


def test_placement_absent_is_the_ring_with_expert_replicas() -> None:
    config = parse_afd_config({**FFN2, "expert_replicas": 2})
    assert config.placement is None
    assert config.placement_for(5) == Placement.ring(5, 2, 2)
    assert config.placement_for(5).held_by(0) == (0, 1, 2, 3, 4) and config.placement_for(5).primary(0) == (0, 1, 2)


def test_placement_table_parses_to_its_holders_and_sets_expert_replicas() -> None:
    config = parse_afd_config({**FFN2, "placement": {"holders": [[1], [0, 1], [0]]}})
    assert config.placement == PlacementConfig(((1,), (0, 1), (0,)))
    assert config.expert_replicas == 2  # the most holders of an expert
    assert config.placement_for(3) == Placement.from_table([[1], [0, 1], [0]], 2)
    assert parse_afd_config({**FFN2, "placement": {"holders": [[1], [0]]}, "expert_replicas": 1}).expert_replicas == 1
    assert parse_afd_config({**FFN2, "placement": None}).placement is None
    hash(config)


@pytest.mark.parametrize(
    ("placement", "extra", "message"),
    [
        ([[0], [1]], {}, r"^afd\.placement: expected a mapping"),
        ({}, {}, r"^afd\.placement\.holders: required key is missing$"),
        ({"holders": [[0], [1]], "kind": "x"}, {}, r"^afd\.placement\.kind: unknown key; accepted keys: holders$"),
        ({"holders": [[0], ["1"]]}, {}, r"^afd\.placement\.holders: expected a list of lists of FFN ranks"),
        ({"holders": [[0], [True]]}, {}, r"^afd\.placement\.holders: expected a list of lists of FFN ranks"),
        ({"holders": [[0], [2]]}, {}, r"^afd\.placement\.holders: expert 1: holders \[2\] must be 1\.\.2 distinct"),
        ({"holders": [[0], [0]]}, {}, r"^afd\.placement\.holders: FFN rank\(s\) 1 hold no expert"),
        ({"holders": []}, {}, r"^afd\.placement\.holders: the placement table lists no expert$"),
        (
            {"holders": [[0], [1]]},
            {"expert_replicas": 2},
            r"^afd\.expert_replicas: 2 disagrees with afd\.placement \(the table's most holders of an expert: 1\); "
            r"leave it out$",
        ),
    ],
)
def test_a_bad_placement_is_one_line_naming_the_key(placement: object, extra: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        parse_afd_config({**FFN2, **extra, "placement": placement})
    assert "\n" not in str(refused.value)


def test_the_table_must_place_the_models_experts() -> None:
    config = parse_afd_config({**FFN2, "placement": {"holders": [[0], [1]]}})
    with pytest.raises(ConfigError, match=r"^afd\.placement\.holders: the table places 2 experts, the model has 4"):
        config.placement_for(4)
    with pytest.raises(ConfigError, match=r"^afd\.num_ffn_ranks: num_experts \(1\) must be at least the FFN ranks"):
        parse_afd_config(FFN2).placement_for(1)
