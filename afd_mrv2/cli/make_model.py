"""``afd-mrv2 make-model``: write a tiny, seeded MoE checkpoint vLLM loads with no download."""

from __future__ import annotations

import argparse
import dataclasses
import json

from afd_mrv2.cli import add_command


def register(sub: argparse._SubParsersAction) -> None:
    from afd_mrv2.checkpoints.archs import ARCHS

    parser = add_command(
        sub,
        "make-model",
        "write a tiny seeded MoE checkpoint (config, tokenizer, safetensors) into DIR",
        (
            "Writes config.json, generation_config.json, a locally trained tokenizer (tokenizer.json) and "
            "model.safetensors with weights drawn from N(0, 0.08) (norms are ones) by a seeded generator: "
            "the same arguments give the same bytes.  The model depends on its routed-expert output, so "
            "comparing AFD with plain vLLM on it is meaningful."
        ),
    )
    parser.add_argument("dir", metavar="DIR", help="the model folder to write")
    parser.add_argument("--arch", required=True, choices=ARCHS, help="model architecture")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers, each with a MoE (default 2)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size, a multiple of 64 (default 128)")
    parser.add_argument("--experts", type=int, default=8, help="routed experts per layer (default 8)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty DIR")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from afd_mrv2.checkpoints.archs import ModelShape
    from afd_mrv2.checkpoints.make import make_checkpoint

    shape = ModelShape(args.arch, args.layers, args.hidden, args.experts, args.top_k, args.seed)
    written = make_checkpoint(args.dir, shape, overwrite=args.overwrite)
    if args.json:
        print(json.dumps(dataclasses.asdict(written)))
    else:
        print(
            f"afd-mrv2 make-model: wrote {written.folder} ({written.arch}, {written.parameters:,} parameters, "
            f"tokenizer vocab {written.tokenizer_vocab}): {', '.join(written.files)}"
        )
    return 0
