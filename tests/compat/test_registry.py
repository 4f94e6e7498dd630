"""``replace_oot_layer``: the one registry write, refused unless the entry is the expected class and the
replacement extends it (a plain dict stands in for vLLM's ``op_registry_oot``: vLLM is not in the unit venv;
the CPU vehicle runs it on the real registry, tests/ascend_vehicle/test_adapters.py)."""

from __future__ import annotations

import logging
import re

import pytest

from afd_mrv2.compat.registry import RegistryRefused, replace_oot_layer


class Platform:
    pass


class Adapter(Platform):
    pass


class Other:
    pass


def test_replaces_the_expected_entry_with_a_subclass(caplog: pytest.LogCaptureFixture) -> None:
    registry: dict[str, type] = {"RoutedExperts": Platform, "MoERunner": Other}
    with caplog.at_level(logging.INFO, logger="afd_mrv2.compat.registry"):
        replace_oot_layer("RoutedExperts", Platform, Adapter, registry=registry)
    assert registry == {"RoutedExperts": Adapter, "MoERunner": Other}
    assert "'RoutedExperts'" in caplog.text and "test_registry.Adapter" in caplog.text


@pytest.mark.parametrize(
    ("entry", "found"),
    [(None, "found nothing"), (Other, "found tests.compat.test_registry.Other")],
    ids=["missing", "other"],
)
def test_refuses_an_entry_that_is_not_the_expected_class(entry: type | None, found: str) -> None:
    registry: dict[str, type] = {} if entry is None else {"RoutedExperts": entry}
    before = dict(registry)
    with pytest.raises(
        RegistryRefused, match=rf"expected tests\.compat\.test_registry\.Platform .*, {re.escape(found)}$"
    ):
        replace_oot_layer("RoutedExperts", Platform, Adapter, registry=registry)
    assert registry == before


def test_refuses_a_subclass_of_the_expected_class_already_there() -> None:
    """A second replacement over the first is refused: the entry is no longer the platform's class."""
    registry: dict[str, type] = {"RoutedExperts": Adapter}
    with pytest.raises(RegistryRefused, match=r"found tests\.compat\.test_registry\.Adapter$"):
        replace_oot_layer("RoutedExperts", Platform, Adapter, registry=registry)


@pytest.mark.parametrize("replacement", [Other, Platform], ids=["unrelated", "the-same-class"])
def test_refuses_a_replacement_that_does_not_extend_the_entry(replacement: type) -> None:
    registry: dict[str, type] = {"RoutedExperts": Platform}
    with pytest.raises(RegistryRefused, match=r"does not extend tests\.compat\.test_registry\.Platform;"):
        replace_oot_layer("RoutedExperts", Platform, replacement, registry=registry)
    assert registry == {"RoutedExperts": Platform}
