"""``afd-mrv2 run``: the embedded AFD deployment, the project's main job.

Three ways to start it, one code path:

* ``afd-mrv2 run``: the local launcher starts A attention + F FFN processes on
  this machine (loopback, free port) and prints the report;
* ``torchrun ... --no-python afd-mrv2 run ...``: every rank runs this command with
  torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``; rank 0 prints
  the report (works across machines);
* the same variables set by hand, one process per rank.

See docs/embedded-run.md.
"""

from __future__ import annotations

import argparse
import os

from afd_mrv2 import envs
from afd_mrv2.cli import add_buffer_options, add_command, add_retired_spelling
from afd_mrv2.config import TRANSPORTS, parse_afd_config
from afd_mrv2.errors import AfdError
from afd_mrv2.hooks.quant_modes import QUANT_MODES
from afd_mrv2.plugins import check_plugins
from afd_mrv2.reference.runconfig import LINKS, RunConfig
from afd_mrv2.reference.spec import ROUTINGS, BatchSpec, ModelSpec
from afd_mrv2.stages import SPLITS
from afd_mrv2.stages.layout import LAYOUTS

DEFAULT_SPLIT_REQUESTS = 4


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = add_command(
        sub,
        "run",
        "run the embedded AFD deployment: attention + FFN processes, serialized vs multistream",
        (
            "Launches A attention and F FFN processes (torch.distributed gloo, torch_p2p connector), runs the "
            "same prefill batches of a tiny DeepSeek-V2-style MoE model through L layers serialized and "
            "multistream, and reports per-layer latency, speedup, overlap efficiency, max |diff| against a "
            "single-process reference forward, a merged Chrome trace and a timeline PNG. Under torchrun (RANK and "
            "WORLD_SIZE set) each process runs one rank instead."
        ),
    )
    _topology_options(parser.add_argument_group("topology and schedule"))
    _model_options(parser.add_argument_group("model"))
    _link_options(parser.add_argument_group("link and faults"))
    _plugin_options(parser.add_argument_group("plugins"))
    parser.add_argument("--out", default="out/afd-run", help="output directory (default out/afd-run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.set_defaults(handler=run)


def _topology_options(topo: argparse._ArgumentGroup) -> None:
    """Ranks, micro-batches and the async-MoE split; then the batches and schedule (:func:`_schedule_options`)."""
    topo.add_argument("--attention", type=int, default=2, metavar="A", help="attention ranks (default 2)")
    topo.add_argument(
        "--ffn",
        type=int,
        default=1,
        metavar="F",
        help="FFN ranks, any number >= 1; experts are sharded over them (default 1)",
    )
    topo.add_argument("--layers", type=int, default=4, help="model layers (default 4)")
    ubatches = topo.add_argument(
        "--ubatches",
        type=int,
        default=None,
        metavar="N",
        help="micro-batches of whole requests per prefill batch (default 4)",
    )
    add_retired_spelling(topo, "--stages", ubatches)
    per_ubatch = topo.add_argument(
        "--requests-per-ubatch", type=int, default=None, metavar="N", help="requests per micro-batch (default 2)"
    )
    add_retired_spelling(topo, "--requests-per-stage", per_ubatch)
    topo.add_argument(
        "--async-moe-split",
        choices=SPLITS,
        default=None,
        help="plan each batch into the async-MoE planner's two stages instead of the micro-batches: token (cut the "
        "flattened tokens in half; a request crossing the cut continues in stage 2 as a chunked prefill) or request "
        "(cut at the most balanced request boundary)",
    )
    topo.add_argument(
        "--requests",
        type=_counts,
        default=None,
        metavar="N[,N...]",
        help=f"with --async-moe-split: requests per batch (default {DEFAULT_SPLIT_REQUESTS}); "
        "--requests 1 --min-len 96 --max-len 96 is one long prefill, which the token split cuts mid-request; "
        "a list N0,N1,... gives attention DP rank a in batch b N[(a + b) %% len] requests: with --attention 2, "
        "--requests 4,4,1 splits batch 0 and runs batches 1 and 2 unsplit on every rank (one rank has 1 request, "
        "which the request split cannot cut; the ranks decide together)",
    )
    topo.add_argument(
        "--attention-tp",
        type=int,
        default=1,
        metavar="T",
        help="with --async-moe-split: T tensor-parallel processes per attention DP rank (default 1); each hands "
        "the CAM boundary its shard of a stage (see --layout)",
    )
    topo.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="tp",
        help="with --attention-tp: sp (sequence parallel: the residual is sharded, parent shards are converted "
        "into stage shards and restored after the last layer) or tp (plain TP: replicated residual, sharded only "
        "at the CAM boundary, the FFN output all-gathered) (default tp)",
    )
    _schedule_options(topo)


def _schedule_options(topo: argparse._ArgumentGroup) -> None:
    """Request lengths, batches, buffers and routing."""
    topo.add_argument("--min-len", type=int, default=16, help="shortest request, tokens (default 16)")
    topo.add_argument("--max-len", type=int, default=32, help="longest request, tokens (default 32)")
    topo.add_argument("--batches", type=int, default=3, help="measured batches per mode (default 3)")
    topo.add_argument("--warmup", type=int, default=1, help="warm-up batches per mode (default 1)")
    add_buffer_options(topo, default="3", what="run multistream with", retired=("--depth",))
    topo.add_argument("--routing", choices=ROUTINGS, default="balanced", help="routing scenario (default balanced)")


def _model_options(model: argparse._ArgumentGroup) -> None:
    """The tiny MoE model."""
    model.add_argument("--hidden", type=int, default=ModelSpec.hidden_size, help="hidden size (default %(default)s)")
    model.add_argument(
        "--experts",
        type=int,
        default=ModelSpec.num_experts,
        help="routed experts, a multiple of F (default %(default)s)",
    )
    model.add_argument("--top-k", type=int, default=ModelSpec.top_k, help="experts per token (default %(default)s)")
    model.add_argument(
        "--expert-size",
        type=int,
        default=ModelSpec.expert_size,
        help="routed and shared expert width (default %(default)s)",
    )
    model.add_argument("--seed", type=int, default=0, help="weights and inputs seed (default %(default)s)")


def _link_options(link: argparse._ArgumentGroup) -> None:
    """The link, its simulated cost, deadlines and quantisation."""
    link.add_argument("--link", choices=LINKS, default="gloo", help="gloo, or gloo plus a simulated link cost")
    link.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="gloo",
        help="what the Attention-FFN pairs run on: gloo (one group of all ranks), zmq or tcp (a connection per "
        "pair, as afd.transport on the vLLM path; default %(default)s)",
    )
    link.add_argument(
        "--sim-latency-us", type=float, default=None, help="simulated latency per transfer (default: balanced)"
    )
    link.add_argument("--sim-bandwidth-gbps", type=float, default=0.0, help="simulated bandwidth (0 = infinite)")
    link.add_argument("--recv-timeout-s", type=float, default=30.0, help="deadline for a silent peer (default 30)")
    link.add_argument(
        "--quant",
        choices=QUANT_MODES,
        default=None,
        help="w8a8: dispatch hidden rows as per-token int8 + fp32 scales, dequantized in the FFN compute; "
        "max |diff| is then checked against a bound derived from the int8 step (default: fp32 rows)",
    )
    link.add_argument(
        "--grace-s", type=float, default=10.0, help="launcher: seconds the others get after a failure (default 10)"
    )


def _plugin_options(plugins: argparse._ArgumentGroup) -> None:
    """The connector and observers."""
    plugins.add_argument(
        "--connector",
        default="torch_p2p",
        help="installed connector to run (default torch_p2p; a third-party one must take torch_p2p's "
        "context fields and compute signature, e.g. a subclass)",
    )
    plugins.add_argument(
        "--observer",
        action="append",
        default=[],
        metavar="NAME",
        help="installed observer to wrap every rank's phases (repeatable)",
    )


def _batch_layout(args: argparse.Namespace) -> tuple[int, int]:
    """(micro-batches, requests per micro-batch) of the BatchSpec; under a split one group of ``--requests``
    requests."""
    if args.async_moe_split is None:
        if args.requests is not None:
            raise AfdError(
                "--requests only applies with --async-moe-split (without it use --ubatches and --requests-per-ubatch)"
            )
        return (
            4 if args.ubatches is None else args.ubatches,
            2 if args.requests_per_ubatch is None else args.requests_per_ubatch,
        )
    if args.ubatches is not None or args.requests_per_ubatch is not None:
        raise AfdError(
            "--async-moe-split plans each batch into the planner's two stages: give the batch size with --requests N, "
            "not --ubatches / --requests-per-ubatch"
        )
    return 1, DEFAULT_SPLIT_REQUESTS if args.requests is None else max(args.requests)


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N,N,... (integers), got {text!r}") from None
    return counts


def config_from_args(args: argparse.Namespace) -> RunConfig:
    stages, requests_per_stage = _batch_layout(args)
    try:
        return RunConfig(
            num_attention=args.attention,
            num_ffn=args.ffn,
            model=ModelSpec(
                hidden_size=args.hidden,
                num_layers=args.layers,
                num_experts=args.experts,
                top_k=args.top_k,
                expert_size=args.expert_size,
                shared_size=args.expert_size,
                seed=args.seed,
            ),
            async_moe_split=args.async_moe_split,
            attention_tp=args.attention_tp,
            layout=args.layout,
            requests=args.requests if args.requests is not None and len(args.requests) > 1 else (),
            batch=BatchSpec(
                stages=stages,
                requests_per_stage=requests_per_stage,
                min_len=args.min_len,
                max_len=args.max_len,
                seed=args.seed + 1,
            ),
            routing=args.routing,
            batches=args.batches,
            warmup=args.warmup,
            depths=(3,) if args.depths is None and not args.buffers else tuple(args.depths or ()),
            buffers=tuple((i, o) for i, o in args.buffers),
            link=args.link,
            transport=args.transport,
            sim_latency_us=args.sim_latency_us,
            sim_bandwidth_gbps=args.sim_bandwidth_gbps,
            recv_timeout_s=args.recv_timeout_s,
            quant=args.quant,
            connector=args.connector,
            observers=tuple(args.observer),
            out_dir=args.out,
        )
    except ValueError as exc:
        raise AfdError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    worker_config = envs.run_config()
    if worker_config is not None:  # a worker started by the local launcher
        return _run_worker(RunConfig.from_json(worker_config), as_json=args.json)
    cfg = config_from_args(args)
    # resolve the plugins and check their hook API versions before any process or link exists
    check_plugins(parse_afd_config({"connector": cfg.connector, "observers": list(cfg.observers), "role": "attention"}))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun or by hand: one rank
        return _run_worker(cfg, as_json=args.json)
    from afd_mrv2.reference.launcher import launch

    return launch(cfg, as_json=args.json, grace_s=args.grace_s)


def _run_worker(cfg: RunConfig, *, as_json: bool) -> int:
    """One rank of the run, in this process (imports torch; the launcher itself never does)."""
    from afd_mrv2.reference.worker import run_worker

    return run_worker(cfg, as_json=as_json)
