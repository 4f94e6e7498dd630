"""The contracts on Ascend trees, without the sdist: platform detection, sdist metadata, stacked sources,
``statements``/``entries`` seams, and the Ascend row's claims (granted and withheld capabilities).

The real vllm 0.30.0 wheel with the vllm-ascend 0.30.0rc2 sdist is checked by the vehicle
(tests/ascend_vehicle/test_ascend_contracts.py); these trees are written here, a few lines each.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from afd_mrv2.cli import main
from afd_mrv2.compat.ascend_seams import ASCEND_SEAMS, ASCEND_UBATCH_SEAMS
from afd_mrv2.compat.contracts import DirectorySource, StackSource, check_contracts, claimed_rows, open_sources
from afd_mrv2.compat.seam import Seam
from afd_mrv2.compat.table import PAIRS

ROW = next(p for p in PAIRS if p.name == "ascend-0.30.0rc2")
BLOCKERS = [s for s in ASCEND_UBATCH_SEAMS if s.blocks]


def _vllm_tree(root: Path, version: str = "0.30.0") -> Path:
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    (root / f"vllm-{version}.dist-info").mkdir()
    return root


def _sdist_tree(root: Path, version: str = "0.30.0rc2", *, egg_info: bool = True) -> Path:
    """An unpacked vllm-ascend sdist's layout: the package, PKG-INFO at the root and in the egg-info."""
    (root / "vllm_ascend").mkdir(parents=True)
    (root / "vllm_ascend" / "__init__.py").write_text("")
    pkg_info = f"Metadata-Version: 2.4\nName: vllm_ascend\nVersion: {version}\nSummary: x\n"
    (root / "PKG-INFO").write_text(pkg_info)
    if egg_info:
        (root / "vllm_ascend.egg-info").mkdir()
        (root / "vllm_ascend.egg-info" / "PKG-INFO").write_text(pkg_info)
    return root


def _write(root: Path, module: str, text: str) -> None:
    path = root / (module.replace(".", "/") + ".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_statements_dict_entries_and_literals(tmp_path: Path) -> None:
    """``statements``: simple statements as ast.unparse writes them (an assert also without its message);
    ``entries``: string-keyed dict-literal items; ``literals``: string constants; anywhere in the definition
    (or the module)."""
    _sdist_tree(tmp_path)
    _write(
        tmp_path,
        "vllm_ascend.mod",
        "def register(cfg):\n"
        "    ops = {'RoutedExperts': Experts, 'MoERunner': Runner}\n"
        "    if cfg:\n"
        "        ops.update({'RoutedExperts': Experts310})\n"
        "    for name, cls in ops.items():\n"
        "        CustomOp.register_oot(_decorated_op_cls=cls, name=name)\n"
        "def prepare(ubatch_idx=0):\n"
        "    assert ubatch_idx == 0, 'no DBO'\n"
        "patched.initialize = initialize\n"
        "class Proxy:\n"
        "    extra_attrs = ('moe_comm_type', 'moe_comm_method')\n",
    )
    held = [
        Seam("vllm-ascend", "vllm_ascend.mod", "register", "a", entries=(("RoutedExperts", "Experts310"),)),
        Seam(
            "vllm-ascend",
            "vllm_ascend.mod",
            "register",
            "b",
            statements=("CustomOp.register_oot(_decorated_op_cls=cls, name=name)",),
        ),
        Seam("vllm-ascend", "vllm_ascend.mod", "prepare", "c", statements=("assert ubatch_idx == 0",)),
        Seam("vllm-ascend", "vllm_ascend.mod", "prepare", "d", statements=("assert ubatch_idx == 0, 'no DBO'",)),
        Seam("vllm-ascend", "vllm_ascend.mod", "", "e", statements=("patched.initialize = initialize",)),
        Seam("vllm-ascend", "vllm_ascend.mod", "Proxy", "f", literals=("moe_comm_type", "moe_comm_method")),
    ]
    assert check_contracts(DirectorySource(tmp_path), held).violations == []
    drifted = [
        Seam("vllm-ascend", "vllm_ascend.mod", "register", "f", entries=(("MoERunner", "Runner310"),)),
        Seam("vllm-ascend", "vllm_ascend.mod", "register", "g", statements=("CustomOp.register_oot(cls)",)),
        Seam("vllm-ascend", "vllm_ascend.mod", "prepare", "h", statements=("assert ubatch_idx < 2",)),
        Seam("vllm-ascend", "vllm_ascend.mod", "register", "i", statements=("assert ubatch_idx == 0",)),
        Seam("vllm-ascend", "vllm_ascend.mod", "Proxy", "j", literals=("in_profile_run",)),
    ]
    report = check_contracts(DirectorySource(tmp_path), drifted)
    assert [(v.seam.why, v.message) for v in report.violations] == [
        ("f", "no longer maps 'MoERunner' to Runner310"),
        ("g", "no longer runs `CustomOp.register_oot(cls)`"),
        ("h", "no longer runs `assert ubatch_idx < 2`"),
        ("i", "no longer runs `assert ubatch_idx == 0`"),  # in another definition: not this one's
        ("j", "no longer holds the string 'in_profile_run'"),
    ]


@pytest.mark.parametrize("egg_info", [True, False], ids=["egg-info", "root-PKG-INFO"])
def test_a_tree_holding_vllm_ascend_is_platform_ascend_with_its_sdist_version(tmp_path: Path, egg_info: bool) -> None:
    report = check_contracts(DirectorySource(_sdist_tree(tmp_path, egg_info=egg_info)), ASCEND_SEAMS)
    assert report.platform == "ascend" and report.versions == {"vllm-ascend": "0.30.0rc2"}
    assert report.absent == ["vllm"] and report.providers == {}
    # only the vllm-ascend seams are checked (the vLLM ones need a vllm package); no row is claimed without vLLM
    assert report.checked == {"vllm-ascend": len([s for s in ASCEND_SEAMS if s.distribution == "vllm-ascend"])}
    assert claimed_rows(report) == []


def test_vllm_ascend_without_metadata_leaves_the_platform_unknown(tmp_path: Path) -> None:
    """A bare package (a stand-in, a copy): like vllm without a dist-info, every seam is checked, no row claimed."""
    _vllm_tree(tmp_path)
    (tmp_path / "vllm_ascend").mkdir()
    (tmp_path / "vllm_ascend" / "__init__.py").write_text("")
    report = check_contracts(DirectorySource(tmp_path))
    assert report.platform is None and report.skipped == [] and claimed_rows(report) == []
    assert report.versions == {"vllm": "0.30.0"} and not [v for v in report.violations if "table row" in v.message]


def test_a_stack_reads_vllm_from_one_source_and_vllm_ascend_from_another(tmp_path: Path) -> None:
    stack = open_sources([_vllm_tree(tmp_path / "wheel"), _sdist_tree(tmp_path / "sdist")])
    assert isinstance(stack, StackSource) and stack.label == f"{tmp_path / 'wheel'} + {tmp_path / 'sdist'}"
    assert stack.has_package("vllm") and stack.has_package("vllm_ascend")
    assert stack.dist_version("vllm") == "0.30.0" and stack.dist_version("vllm-ascend") == "0.30.0rc2"
    assert not isinstance(open_sources([tmp_path / "wheel"]), StackSource)
    with pytest.raises(ValueError, match="no source"):
        open_sources([])


def test_the_ascend_rows_claims_are_checked_against_the_release(tmp_path: Path) -> None:
    """A tree that says it is vllm 0.30.0 + vllm-ascend 0.30.0rc2 but lacks every seam: the Ascend row's grants
    (mrv2, moe_seam) are VIOLATIONS naming each seam, and so is its ubatch_runner refusal, whose upstream facts
    are gone; the CUDA 0.30.0 row is not claimed (the platform is ascend)."""
    source = StackSource([DirectorySource(_vllm_tree(tmp_path / "v")), DirectorySource(_sdist_tree(tmp_path / "a"))])
    report = check_contracts(source)
    assert report.platform == "ascend" and [r.name for r in claimed_rows(report)] == ["ascend-0.30.0rc2"]
    claims = {(v.seam.symbol, v.message.split(" but")[0]) for v in report.violations if "table row" in v.message}
    for capability in ("mrv2", "moe_seam"):
        wanted = {
            s.symbol
            for s in ASCEND_SEAMS
            if s.capability == capability and (s.distribution == "vllm-ascend" or s.platforms == {"ascend"})
        }
        assert wanted <= {sym for sym, claim in claims if claim == f"table row {ROW.name} grants {capability!r}"}
    withheld = {sym for sym, claim in claims if "withholds" in claim}
    assert withheld == {s.symbol for s in BLOCKERS}
    assert report.unblocked.keys() == {"ubatch_runner"} and report.blocked == {}
    assert not [v for v in report.violations if "cuda-vllm-0.30.0" in v.message]
    # another vllm-ascend release: no row claimed, the same tree reports capabilities not offered instead
    other = check_contracts(
        StackSource([DirectorySource(tmp_path / "v"), DirectorySource(_sdist_tree(tmp_path / "b", "0.30.0rc1"))])
    )
    assert claimed_rows(other) == [] and not [v for v in other.violations if "table row" in v.message]
    assert {"mrv2", "moe_seam"} <= other.capabilities_missing.keys()


def test_a_row_granting_what_upstream_blocks_is_a_violation(tmp_path: Path) -> None:
    """While the DBO switch-off holds, a row of that release granting ubatch_runner contradicts it."""
    _vllm_tree(tmp_path)
    _sdist_tree(tmp_path)
    _write(
        tmp_path,
        "vllm_ascend.platform",
        "def _fix_incompatible_config(vllm_config):\n"
        "    vllm_config.parallel_config.enable_dbo = False\n"
        "    vllm_config.parallel_config.ubatch_size = 0\n",
    )
    blocker = next(s for s in BLOCKERS if s.module == "vllm_ascend.platform")
    granting = replace(ROW, capabilities=ROW.capabilities | {"ubatch_runner"}, withheld=())
    report = check_contracts(DirectorySource(tmp_path), [blocker], pairs=(granting,))
    assert report.blocked == {"ubatch_runner": [blocker.symbol]}
    assert [str(v) for v in report.violations] == [
        f"{blocker.symbol}: table row ascend-0.30.0rc2 grants 'ubatch_runner' but upstream blocks it: {blocker.why}"
    ]
    assert check_contracts(DirectorySource(tmp_path), [blocker]).violations == []  # the shipped row withholds it


def test_the_cli_reads_several_dists_as_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    vllm, sdist = _vllm_tree(tmp_path / "v"), _sdist_tree(tmp_path / "a")
    assert main(["compat", "contracts", "--dist", str(vllm), "--dist", str(sdist), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["platform"] == "ascend" and report["versions"] == {"vllm": "0.30.0", "vllm-ascend": "0.30.0rc2"}
    assert report["source"] == f"{vllm} + {sdist}" and report["unblocked"].keys() == {"ubatch_runner"}
    assert main(["compat", "contracts", "--dist", str(vllm), "--dist", str(sdist)]) == 1
    out = capsys.readouterr().out
    assert "vllm shipped by the vllm distribution: platform ascend" in out and "contracts: FAIL" in out
    assert "capability ubatch_runner: a fact that blocked it is gone" in out
