"""The ``afd.async_moe`` section: defaults, parsing and config-time refusals."""

from __future__ import annotations

import pytest

from afd_mrv2.config import AsyncMoeConfig, parse_afd_config
from afd_mrv2.errors import ConfigError


def parse(**afd: object):
    return parse_afd_config({"connector": "camasync", "role": "attention", **afd})


def test_defaults_are_one_stage() -> None:
    config = parse()
    assert config.async_moe == AsyncMoeConfig(enabled=False, split="request", num_stages=2)
    assert config.async_moe.stages == 1
    hash(config)  # still hashable (vLLM hashes additional_config)


def test_enabled_token_split() -> None:
    config = parse(compute_gate_on_attention=True, async_moe={"enabled": True, "split": "token", "num_stages": 2})
    assert config.async_moe.split == "token" and config.async_moe.stages == 2


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            {"num_stages": 3},
            "afd.async_moe.num_stages: expected 2 (the async-MoE split supports exactly two stages), got 3 (int)",
        ),
        ({"num_stages": 1}, "afd.async_moe.num_stages: expected 2"),
        ({"num_stages": True}, "afd.async_moe.num_stages: expected 2"),
        ({"split": "layer"}, "afd.async_moe.split: expected one of request, token, got 'layer' (str)"),
        ({"enabled": "yes"}, "afd.async_moe.enabled: expected true or false"),
        ({"stages": 2}, "afd.async_moe.stages: unknown key; accepted keys: enabled, num_stages, split"),
        ("on", "afd.async_moe: expected a mapping"),
    ],
)
def test_bad_values_fail_with_one_line(section: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(compute_gate_on_attention=True, async_moe=section)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_more_than_two_stages_is_refused_even_when_disabled() -> None:
    with pytest.raises(ConfigError, match="num_stages"):
        parse(async_moe={"enabled": False, "num_stages": 4})


def test_enabled_needs_the_gate_on_attention() -> None:
    with pytest.raises(ConfigError) as info:
        parse(compute_gate_on_attention=False, async_moe={"enabled": True})
    assert info.value.key == "afd.async_moe.enabled"
    assert "afd.compute_gate_on_attention" in str(info.value)
