"""``afd-mrv2 make-model``: write a seeded MoE checkpoint vLLM loads with no download (``--size tiny`` or ``bench``)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from afd_mrv2.cli import add_command


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from afd_mrv2.checkpoints.archs import ARCHS, PRESETS, SIZES

    tiny, bench = PRESETS["tiny"], PRESETS["bench"]
    parser = add_command(
        sub,
        "make-model",
        "write a seeded MoE checkpoint (config, tokenizer, safetensors) into DIR: tiny, or sized for benchmarks",
        (
            "Writes config.json, generation_config.json, a locally trained tokenizer (tokenizer.json) and "
            "model.safetensors (with --expert-shard: the routed experts and the rest in two shards and an index) "
            "with weights drawn from N(0, 0.08) (norms are ones) by a seeded generator: "
            "the same arguments give the same bytes.  The model depends on its routed-expert output, so "
            "comparing AFD with plain vLLM on it is meaningful.  --size tiny (the default) is the small "
            "checkpoint the equivalence tests use; --size bench is sized so that micro-batching pays: it "
            "also measures, on one core, each AFD side's per-layer compute for a 64-sequence decode step "
            "and for half of it, and prints them with PASS/FAIL against the criteria (half <= 0.6 of full "
            "on both sides, the two halves within 1.5x); docs/benchmarks-vllm.md, 'The bench checkpoint'."
        ),
    )
    parser.add_argument("dir", metavar="DIR", help="the model folder to write")
    parser.add_argument("--arch", required=True, choices=ARCHS, help="model architecture")
    parser.add_argument(
        "--size",
        default="tiny",
        metavar="{" + ",".join(SIZES) + "}",
        help=(
            f"dimension preset (default tiny: {tiny.layers} layers, hidden {tiny.hidden}, {tiny.experts} experts, "
            f"top-{tiny.top_k}, intermediate 2 x hidden; bench: {bench.layers} layers, hidden {bench.hidden}, "
            f"{bench.experts} experts, top-{bench.top_k}, intermediate {bench.intermediate}); the flags below "
            "override single dimensions"
        ),
    )
    _dimension_flags(parser)
    _output_flags(parser)
    parser.set_defaults(handler=run)


def _dimension_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that override single dimensions of the preset."""
    parser.add_argument("--layers", type=int, default=None, help="decoder layers, each with a MoE")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size, a multiple of 64 (the head size)")
    parser.add_argument("--experts", type=int, default=None, help="routed experts per layer")
    parser.add_argument("--top-k", type=int, default=None, help="experts per token")
    parser.add_argument("--intermediate", type=int, default=None, help="each expert's intermediate size")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")


def _output_flags(parser: argparse.ArgumentParser) -> None:
    """What is measured and written, and how it is reported."""
    parser.add_argument(
        "--measure",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure the per-layer compute after writing (default: with --size bench only; takes a few seconds)",
    )
    parser.add_argument(
        "--kernels",
        default="auto",
        metavar="{auto,torch,vllm}",
        help=(
            "what measures: torch (a plain-torch emulation of vLLM's CPU ops), vllm (vLLM's own CPU kernels) "
            "or auto (default: vllm where vLLM is installed, else torch)"
        ),
    )
    parser.add_argument(
        "--expert-shard",
        action="store_true",
        help=(
            "write the routed experts' tensors in model-experts.safetensors and all others in "
            "model-rest.safetensors, with a model.safetensors.index.json (same weights; vLLM loads it unchanged)"
        ),
    )
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty DIR")
    parser.add_argument("--json", action="store_true", help="print the summary (and the measurement) as JSON")


def run(args: argparse.Namespace) -> int:
    from afd_mrv2.checkpoints.archs import shape_for
    from afd_mrv2.checkpoints.bench import KERNELS
    from afd_mrv2.checkpoints.make import make_checkpoint
    from afd_mrv2.errors import ConfigError

    if args.kernels not in KERNELS:
        raise ConfigError("--kernels", f"expected one of {', '.join(KERNELS)}, got {args.kernels!r}")

    shape = shape_for(
        args.arch,
        args.size,
        layers=args.layers,
        hidden=args.hidden,
        experts=args.experts,
        top_k=args.top_k,
        intermediate=args.intermediate,
        seed=args.seed,
    )
    written = make_checkpoint(args.dir, shape, overwrite=args.overwrite, expert_shard=args.expert_shard)
    measured = None
    if args.measure or (args.measure is None and args.size == "bench"):
        from afd_mrv2.checkpoints.bench import measure_layer_compute

        measured = measure_layer_compute(shape, kernels=args.kernels)
    if args.json:
        summary: dict[str, object] = {**dataclasses.asdict(written), "size": args.size}
        if measured is not None:
            summary["measurement"] = measured.as_dict()
        print(json.dumps(summary))
    else:
        print(
            f"afd-mrv2 make-model: wrote {written.folder} ({written.arch}, {args.size}: {shape.layers} layers, "
            f"hidden {shape.hidden}, {shape.experts} experts, top-{shape.top_k}, intermediate "
            f"{shape.intermediate}; {written.parameters:,} parameters, tokenizer vocab {written.tokenizer_vocab}): "
            f"{', '.join(written.files)}"
        )
        if measured is not None:
            print(measured.report())
    return 0
