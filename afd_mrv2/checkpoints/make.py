"""Write one tiny checkpoint: seeded weights, config, generation config and a local tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from afd_mrv2.architectures import routed_expert_id
from afd_mrv2.checkpoints.archs import STD, VOCAB, ModelShape, config_json, is_norm, weight_shapes
from afd_mrv2.errors import ConfigError

__all__ = [
    "EXPERTS_FILE",
    "INDEX_FILE",
    "REST_FILE",
    "SINGLE_FILE",
    "STD",
    "Written",
    "draw_weights",
    "make_checkpoint",
    "save_weights",
    "write_tokenizer",
]
CORPUS = (
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny model for attention ffn disaggregation",
    "one two three four five six seven eight nine ten",
    "mixture of experts routes tokens to experts",
)
SPECIAL = ("<s>", "</s>", "<pad>")
SINGLE_FILE = "model.safetensors"
#: ``--expert-shard``'s two files and the index naming each tensor's file
EXPERTS_FILE, REST_FILE, INDEX_FILE = (
    "model-experts.safetensors",
    "model-rest.safetensors",
    "model.safetensors.index.json",
)


def draw_weights(shape: ModelShape) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, drawn in :func:`weight_shapes` order from one generator seeded with ``shape.seed``
    (N(0, ``shape.std``); norms are ones)."""
    g = torch.Generator().manual_seed(shape.seed)
    out = {}
    for name, dims in weight_shapes(shape).items():
        out[name] = torch.ones(dims) if is_norm(name) else (torch.randn(*dims, generator=g) * shape.std).contiguous()
    return out


def write_tokenizer(folder: Path) -> int:
    """Train a byte-level BPE tokenizer on a fixed corpus (deterministic) and save it; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(CORPUS) * 10, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    bos, eos, pad = SPECIAL
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "model_max_length": 512,
        "add_bos_token": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return tokenizer.get_vocab_size()


@dataclass(frozen=True)
class Written:
    """What :func:`make_checkpoint` wrote."""

    folder: str
    arch: str
    parameters: int
    tokenizer_vocab: int
    files: tuple[str, ...]


def save_weights(folder: Path, weights: dict[str, torch.Tensor], *, expert_shard: bool) -> None:
    """:data:`SINGLE_FILE`, or with ``expert_shard`` the routed experts' tensors in :data:`EXPERTS_FILE`,
    the others in :data:`REST_FILE` and a standard :data:`INDEX_FILE` (``weight_map``, ``total_size``)."""
    from safetensors.torch import save_file

    stale = (SINGLE_FILE,) if expert_shard else (EXPERTS_FILE, REST_FILE, INDEX_FILE)
    for name in stale:  # the other layout's files, left by an --overwrite
        (folder / name).unlink(missing_ok=True)
    if not expert_shard:
        save_file(weights, str(folder / SINGLE_FILE), metadata={"format": "pt"})
        return
    files = {name: EXPERTS_FILE if routed_expert_id(name) is not None else REST_FILE for name in weights}
    for file in (EXPERTS_FILE, REST_FILE):
        part = {name: t for name, t in weights.items() if files[name] == file}
        save_file(part, str(folder / file), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(files.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")


def make_checkpoint(
    folder: str | Path, shape: ModelShape, *, overwrite: bool = False, expert_shard: bool = False
) -> Written:
    """Write the checkpoint of ``shape`` into ``folder`` (``expert_shard``: see :func:`save_weights`);
    returns a summary (parameters, files)."""
    shape.check()
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()) and not overwrite:
        raise ConfigError("DIR", f"{folder} exists and is not empty (pass --overwrite to replace its files)")
    folder.mkdir(parents=True, exist_ok=True)
    weights = draw_weights(shape)
    save_weights(folder, weights, expert_shard=expert_shard)
    vocab = write_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps(config_json(shape), indent=1) + "\n")
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}) + "\n")
    parameters = sum(t.numel() for t in weights.values())
    return Written(str(folder), shape.arch, parameters, vocab, tuple(sorted(p.name for p in folder.iterdir())))
