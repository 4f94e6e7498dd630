"""Stand-in for vllm.v1.worker.utils.AttentionGroup: metadata builders per micro-batch.

As upstream, a group has as many builders as ``create_metadata_builders`` was asked
for, and asking a single-builder group for micro-batch 1's builder asserts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class MetadataBuilder:
    def __init__(self, index: int) -> None:
        self.index = index

    def build(self, num_tokens: int) -> dict:
        return {"builder": self.index, "num_tokens": num_tokens}


@dataclass
class AttentionGroup:
    layer_names: list[str]
    kernel_block_size: int | None = None
    metadata_builders: list[MetadataBuilder] = field(default_factory=list)

    def create_metadata_builders(self, vllm_config, device, kernel_block_size=None, num_metadata_builders=1):
        self.kernel_block_size = kernel_block_size
        self.metadata_builders = [MetadataBuilder(i) for i in range(num_metadata_builders)]

    def get_metadata_builder(self, ubatch_idx: int = 0) -> MetadataBuilder:
        if len(self.metadata_builders) == 1:
            assert ubatch_idx == 0, "this group has a single metadata builder"
        return self.metadata_builders[ubatch_idx]
