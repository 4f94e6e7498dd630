"""``afd_mrv2.checkpoints.residency``: tensor byte ranges, dropping a file's pages, page residency.

Written under pytest's tmp_path (a disk file system here: a tmpfs never drops pages, and then
the drop test fails, on purpose, rather than skip).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from afd_mrv2.architectures import routed_expert_id
from afd_mrv2.checkpoints.residency import (
    PAGE,
    checkpoint_residency,
    drop_page_cache,
    file_residency,
    range_residency,
    resident_pages,
    tensor_ranges,
)

MIB = 1 << 20


def write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def three_tensors(tmp_path: Path) -> Path:
    """Three 1 MiB tensors (and a 3-byte one that shares its pages with neighbours)."""
    g = torch.Generator().manual_seed(0)
    return write(
        tmp_path / "three.safetensors",
        {
            "a": torch.randn(MIB // 4, generator=g),
            "b": torch.randn(MIB // 4, generator=g),
            "c": torch.randn(MIB // 4, generator=g),
            "tiny": torch.ones(3, dtype=torch.uint8),
        },
    )


def read_range(path: Path, begin: int, end: int) -> bytes:
    """Read ``[begin, end)`` with readahead off, so that only those pages come in."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return os.pread(fd, end - begin, begin)
    finally:
        os.close(fd)


def test_ranges_hold_the_bytes_safetensors_reads(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    tensors = {
        "x.weight": torch.randn(5, 7, generator=g),
        "y.bias": torch.arange(11, dtype=torch.int64),
        "z": torch.randn(3, generator=g).to(torch.bfloat16),
    }
    path = write(tmp_path / "m.safetensors", tensors)
    ranges = tensor_ranges(path)
    assert set(ranges) == set(tensors)
    raw = path.read_bytes()
    with safe_open(str(path), framework="pt") as f:
        for name, (begin, end) in ranges.items():
            t = f.get_tensor(name)
            assert end - begin == t.numel() * t.element_size()
            assert raw[begin:end] == t.contiguous().view(torch.uint8).numpy().tobytes()
    assert max(end for _, end in ranges.values()) == len(raw)


def test_drop_then_read_one_tensor_makes_only_its_pages_resident(tmp_path: Path) -> None:
    path = three_tensors(tmp_path)
    assert file_residency(path) > 0.9  # just written: in the page cache
    drop_page_cache(path)
    assert file_residency(path) < 0.05, (
        f"{path}: pages still resident after POSIX_FADV_DONTNEED; is its file system a tmpfs? "
        "residency cannot be measured there"
    )
    ranges = tensor_ranges(path)
    read_range(path, *ranges["b"])
    seen = range_residency(path, ranges)
    assert seen["b"][0] == seen["b"][1] >= MIB // PAGE - 1  # 1 MiB: 255 or 256 whole pages, all read
    assert seen["a"][0] == 0 and seen["c"][0] == 0
    assert seen["a"][1] >= MIB // PAGE - 1 and seen["c"][1] >= MIB // PAGE - 1
    assert seen["tiny"] == (0, 0)  # no whole page inside 3 bytes
    assert sum(resident_pages(path)) < MIB // PAGE + 4


def test_whole_pages_only(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(4 * PAGE))
    pages = resident_pages(path)
    assert len(pages) == 4
    assert range_residency(path, {"one": (PAGE // 2, 2 * PAGE + 1), "none": (1, PAGE + 1), "all": (0, 4 * PAGE)}) == {
        "one": (sum(pages[1:2]), 1),
        "none": (0, 0),
        "all": (sum(pages), 4),
    }
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    assert resident_pages(empty) == [] and file_residency(empty) == 0.0


@pytest.mark.parametrize(
    ("name", "expert"),
    [
        ("model.layers.0.mlp.experts.7.down_proj.weight", 7),
        ("model.layers.3.block_sparse_moe.experts.12.w1.weight", 12),
        ("model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv", 0),
        ("model.layers.0.mlp.shared_expert.down_proj.weight", None),
        ("model.layers.0.mlp.shared_experts.up_proj.weight", None),
        ("model.layers.0.mlp.shared_expert_gate.weight", None),
        ("model.layers.0.mlp.gate.weight", None),
        ("model.layers.0.self_attn.q_proj.weight", None),
    ],
)
def test_routed_expert_id(name: str, expert: int | None) -> None:
    assert routed_expert_id(name) == expert


def test_checkpoint_residency_splits_routed_experts_from_the_rest(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(2)
    experts = {f"model.layers.0.mlp.experts.{e}.down_proj.weight": torch.randn(64, 1024, generator=g) for e in (0, 1)}
    rest = {"model.layers.0.mlp.shared_expert.down_proj.weight": torch.randn(64, 1024, generator=g)}
    write(tmp_path / "model-experts.safetensors", experts)
    path = write(tmp_path / "model-rest.safetensors", rest)
    for file in tmp_path.glob("*.safetensors"):
        drop_page_cache(file)
    read_range(path, *tensor_ranges(path)["model.layers.0.mlp.shared_expert.down_proj.weight"])
    seen = checkpoint_residency(tmp_path)
    assert seen["routed_experts"][0] == 0 and seen["routed_experts"][1] >= 2 * (64 * 1024 * 4 // PAGE - 1)
    assert seen["other"][0] == seen["other"][1] >= 64 * 1024 * 4 // PAGE - 1
