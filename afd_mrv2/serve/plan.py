"""What ``afd-mrv2 serve`` will start, decided before anything starts.

:func:`build_plan` turns the command line into a :class:`Plan`: one
:class:`RoleSpec` per process (FFN ranks first, the order the handshake needs),
each with its own ``afd`` section, port and argv.  Every check that can fail
runs here, so a bad ``afd`` section, ``--depth``, topology or port is a one-line
:class:`~afd_mrv2.errors.AfdError` before any process exists.

The role command lines are data: a :class:`RoleCommands` pair of builders, each
taking the :class:`RoleContext` of one rank.  The defaults start vLLM's OpenAI
server for an Attention rank and ``afd_mrv2.mrv2.ffn.role`` for an FFN rank;
tests pass builders that start fake roles.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afd_mrv2 import envs
from afd_mrv2.admission import AFD_KEY, Stage, Subject, checkpoint_facts, own_keys_in_env, place_own_keys, run
from afd_mrv2.config import parse_afd_config
from afd_mrv2.errors import AfdError, ConfigError
from afd_mrv2.items import ATTENTION, FFN
from afd_mrv2.mrv2 import WORKER_EXTENSION
from afd_mrv2.options import json_object
from afd_mrv2.placement import Placement
from afd_mrv2.ports import HOST
from afd_mrv2.serve.nodes import Layout, NodeOptions

DEFAULT_PORT = 8000
DEFAULT_CONNECTOR = "torch_p2p"
#: The key serve adds to each role's ``afd`` section: the rank within its role (``AfdConfig.rank``; an Attention
#: group's first rank).
RANK_KEY = "rank"
#: The Attention ranks of each lock-step group (``AfdConfig.attention_group_size``), in every role's section.
GROUP_KEY = "attention_group_size"
#: vLLM's CPU thread binding; serve pins each role to its own cores unless the environment sets it.
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
#: Every role's environment defaults (serve's own environment wins): nothing is downloaded, 1 GiB of CPU KV cache.
ROLE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
#: An FFN role is ready once it prints a line containing this, or once its ready file exists.
FFN_READY_MARKER = "afd-mrv2 ffn: ready"
ADDITIONAL_CONFIG = "--additional-config"
#: Under ``--ubatches N`` (any N, 1 included) the Attention engines run vLLM's Model Runner V2
#: (:data:`afd_mrv2.envs.V2_MODEL_RUNNER` set to 1; vLLM's own choice falls back to V1 on CPU) with afd-mrv2's
#: worker, which builds afd-mrv2's Attention runner over the platform's V2 runner, and eager (no graph capture
#: of split steps).
AFD_WORKER = "afd_mrv2.mrv2.attention.worker.AfdWorker"
WORKER_CLS_FLAG = "--worker-cls"
EAGER_FLAG = "--enforce-eager"
#: Every Attention engine gets afd-mrv2's worker extension: its counters and parameter
#: bytes are readable from inside the worker (``collective_rpc``; over HTTP with vLLM's
#: ``VLLM_SERVER_DEV_MODE=1``, ``POST /collective_rpc {"method": "afd_attention_stats"}``).
WORKER_EXTENSION_FLAG = "--worker-extension-cls"


@dataclass(frozen=True)
class RoleContext:
    """Everything a role command builder may put on one rank's command line."""

    model: str
    role: str
    rank: int
    #: The Attention engine's HTTP port (None for an FFN rank).
    port: int | None
    #: The ``--additional-config`` JSON of this rank (its own ``afd`` section inside).
    additional_config: str
    #: The EXTRA VLLM ARGS after ``--`` (every role gets them).
    extra: tuple[str, ...]
    #: The FFN rank's ready file (None for an Attention rank).
    ready_file: str | None
    #: ``--ubatches N`` for an Attention engine: micro-batches per step on Model Runner V2 with afd-mrv2's
    #: worker (N = 1: unsplit, still V2); None: the flag was not given (vLLM's own runner choice)
    ubatches: int | None = None
    #: the address the role binds: its node's (127.0.0.1 on one node)
    host: str = HOST
    #: an Attention group's data-parallel ranks and each one's tensor-parallel ranks (1 and 1: one engine of one
    #: process, as before groups)
    dp_size: int = 1
    tp_size: int = 1


RoleCommand = Callable[[RoleContext], list[str]]


LOAD_FORMAT = "--load-format"


#: vLLM's flags that lay an engine out over processes: serve sets them for an Attention group (``--attention``,
#: ``--attention-groups``, ``--attention-tp``); after ``--`` they would reach the FFN role too.
GROUP_FLAGS = ("--data-parallel-size", "--tensor-parallel-size", "--api-server-count")


def attention_command(ctx: RoleContext) -> list[str]:
    """One Attention group: one vLLM OpenAI server on its own port of its node's address, its ``dp_size``
    data-parallel ranks (vLLM's own DP engine cores and coordinator, one API server) of ``tp_size`` each."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        ctx.model,
        "--host",
        ctx.host,
        "--port",
        str(ctx.port),
        ADDITIONAL_CONFIG,
        ctx.additional_config,
        WORKER_EXTENSION_FLAG,
        WORKER_EXTENSION,
        *group_engine_args(ctx.dp_size, ctx.tp_size),
        *ubatch_engine_args(ctx),
        *load_format_args(ctx),
        *ctx.extra,
    ]


def group_engine_args(dp_size: int, tp_size: int) -> list[str]:
    """An Attention group's layout: ``--data-parallel-size`` with one API server, ``--tensor-parallel-size``
    (nothing for a group of one process)."""
    args = []
    if dp_size > 1:
        args += ["--data-parallel-size", str(dp_size), "--api-server-count", "1"]
    if tp_size > 1:
        args += ["--tensor-parallel-size", str(tp_size)]
    return args


def load_format_args(ctx: RoleContext) -> list[str]:
    """``--load-format afd``: the Attention engine reads no routed-expert tensor (docs/vllm.md), unless the extra
    arguments choose a format, or the platform keeps its own MoE layer (vLLM-Ascend: afd-mrv2 registers no
    layer and no load format there)."""
    if any(arg == LOAD_FORMAT or arg.startswith(f"{LOAD_FORMAT}=") for arg in ctx.extra):
        return []
    from afd_mrv2.vllm_plugin import replaces_routed_experts

    return [LOAD_FORMAT, "afd"] if replaces_routed_experts() else []


def ubatch_engine_args(ctx: RoleContext) -> list[str]:
    """What an Attention engine under ``--ubatches`` needs on its command line: afd-mrv2's worker and eager mode
    (each unless the extra arguments already choose it); nothing without the flag."""
    if ctx.ubatches is None:
        return []
    args = []
    if not any(a == WORKER_CLS_FLAG or a.startswith(WORKER_CLS_FLAG + "=") for a in ctx.extra):
        args += [WORKER_CLS_FLAG, AFD_WORKER]
    if EAGER_FLAG not in ctx.extra:
        args.append(EAGER_FLAG)
    return args


def ffn_command(ctx: RoleContext) -> list[str]:
    """One FFN rank: ``python -m afd_mrv2.mrv2.ffn.role MODEL -- --additional-config JSON EXTRA...``.

    ``ffn_role`` parses the vLLM arguments after ``--`` with vLLM's own engine-argument
    parser and takes its ``afd`` section from ``--additional-config``; it is ready when
    it prints :data:`FFN_READY_MARKER`.
    """
    return [
        sys.executable,
        "-m",
        "afd_mrv2.mrv2.ffn.role",
        ctx.model,
        "--",
        ADDITIONAL_CONFIG,
        ctx.additional_config,
        *ctx.extra,
    ]


@dataclass(frozen=True)
class RoleCommands:
    attention: RoleCommand = attention_command
    ffn: RoleCommand = ffn_command


@dataclass(frozen=True)
class ServeOptions:
    """The parsed command line of ``afd-mrv2 serve``."""

    model: str
    #: ``--attention A``: Attention data-parallel ranks, all groups together
    attention: int
    ffn: int
    port: int = DEFAULT_PORT
    #: ``--attention-groups G``: the A ranks as G independent vLLM deployments of A/G DP ranks each (1: one group;
    #: A: independent engines)
    attention_groups: int = 1
    #: ``--attention-tp T``: tensor-parallel ranks of each Attention DP rank (the FFN ranks take none)
    attention_tp: int = 1
    depth: str | None = None
    #: ``--expert-replicas R``: afd.expert_replicas, on how many FFN ranks each routed expert lives (None: as configured)
    expert_replicas: int | None = None
    #: ``--no-restart-ffn``: leave a lost FFN rank lost (with replicas; serve runs degraded)
    restart_ffn: bool = True
    #: ``--no-restart-attention``: leave a lost Attention engine lost (with A >= 2)
    restart_attention: bool = True
    #: ``--ubatches N``: afd.ubatch.num_ubatches, and the Attention engines on Model Runner V2 (None: as configured)
    ubatches: int | None = None
    connector: str | None = None
    #: ``--transport gloo|zmq|tcp``: afd.transport, what torch_p2p's pairs run on (None: as configured)
    transport: str | None = None
    #: A base ``afd`` section (JSON text), merged under the flags.
    afd_json: str | None = None
    extra: tuple[str, ...] = ()
    balance: str = "least-outstanding"
    ready_timeout_s: float = 900.0
    stop_grace_s: float = 5.0
    #: ``--nnodes`` and its companions: this node's share of a deployment over several machines
    nodes: NodeOptions = field(default_factory=NodeOptions)
    #: ``--host``: the address the endpoint binds (node 0)
    host: str = HOST
    #: ``--secret-file``: the deployment's secret, the same file on every node (None: generated on one node)
    secret_file: str | None = None


@dataclass(frozen=True)
class RoleSpec:
    role: str
    rank: int
    argv: tuple[str, ...]
    afd: Mapping[str, Any]
    port: int | None = None
    ready_file: str | None = None
    #: Environment defaults for this process (serve's own environment wins over them).
    env: Mapping[str, str] = field(default_factory=dict)
    #: The cores every process of this role runs on (its front end, EngineCore and workers inherit them);
    #: empty: unpinned (the environment sets the binding).
    cores: tuple[int, ...] = ()
    #: the node that runs it, and the address it binds there (empty for another node's role: it tells)
    node: int = 0
    host: str = HOST

    @property
    def name(self) -> str:
        """``attention 0``: the log prefix and the name in messages (an Attention role's rank: its group's index)."""
        return f"{self.role} {self.rank}"

    @property
    def afd_ranks(self) -> tuple[int, ...]:
        """The AFD ranks of its processes: an Attention group's (``afd.rank`` onward, ``attention_group_size`` of
        them), an FFN rank's own."""
        if self.role != ATTENTION:
            return (self.rank,)
        first, size = int(self.afd.get(RANK_KEY, self.rank)), int(self.afd.get(GROUP_KEY, 1))
        return tuple(range(first, first + size))

    @property
    def title(self) -> str:
        """``attention rank 0`` (a group of one process) or ``attention group 0 (AFD ranks 0-1)``."""
        ranks = self.afd_ranks
        if len(ranks) == 1:
            return f"{self.role} rank {self.rank}"
        return f"{self.role} group {self.rank} (AFD ranks {ranks[0]}-{ranks[-1]})"


@dataclass(frozen=True)
class Plan:
    options: ServeOptions
    #: Launch order: every FFN rank, then every Attention rank.
    roles: tuple[RoleSpec, ...]
    run_dir: str
    afd: Mapping[str, Any] = field(default_factory=dict)
    #: the model's routed experts per MoE layer, where its config.json says (set by serve's pre-flight)
    num_experts: int | None = None
    #: the node this plan runs on, its address, and every role rank's node
    node: int = 0
    addr: str = HOST
    layout: Layout | None = None
    #: the deployment's secret: the store's MACs and the pairs' tokens (None: unguarded, gloo on one node)
    secret: bytes | None = field(default=None, repr=False)

    @property
    def local(self) -> tuple[RoleSpec, ...]:
        """The roles this node starts."""
        return tuple(r for r in self.roles if r.node == self.node)

    @property
    def expert_replicas(self) -> int:
        """The most FFN ranks holding one expert (``afd.expert_replicas``, or the table's)."""
        return self.placement.replicas

    @property
    def placement(self) -> Placement:
        """Where the experts live: the table in every role's section (resolved where the expert count is
        known), else the ring by block (E = F)."""
        table = self.afd.get("placement")
        if isinstance(table, Mapping):
            return Placement.from_table(table["holders"], self.options.ffn)
        ffn = self.options.ffn
        return Placement.ring(self.num_experts or ffn, ffn, int(self.afd.get("expert_replicas", 1)))

    def of(self, role: str) -> tuple[RoleSpec, ...]:
        return tuple(r for r in self.roles if r.role == role)

    @property
    def backends(self) -> tuple[str, ...]:
        """Each Attention engine's URL (empty for another node's engine until that node announces it)."""
        return tuple(f"http://{r.host}:{r.port}" if r.host else "" for r in self.of(ATTENTION))

    @property
    def role_ports(self) -> list[int]:
        """The ports this node's roles bind (each local Attention engine's, then the AFD rendezvous on node
        0), after the endpoint's."""
        store = [int(self.afd["port"])] if self.node == 0 else []
        return [p for r in self.local if (p := r.port) is not None] + store


def split_additional_config(extra: Sequence[str]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Take ``--additional-config JSON`` (or ``=JSON``) out of the EXTRA VLLM ARGS: serve rewrites it per role."""
    rest: list[str] = []
    found: dict[str, Any] = {}
    args = iter(extra)
    for arg in args:
        if arg == ADDITIONAL_CONFIG:
            text = next(args, None)
            if text is None:
                raise AfdError(f"{ADDITIONAL_CONFIG} needs a JSON value")
            found = json_object(text, ADDITIONAL_CONFIG)
        elif arg.startswith(ADDITIONAL_CONFIG + "="):
            found = json_object(arg.split("=", 1)[1], ADDITIONAL_CONFIG)
        else:
            rest.append(arg)
    return found, tuple(rest)


def _depth_value(depth: str) -> int | str:
    return int(depth) if depth.strip().lstrip("-").isdigit() else depth


def _with_flags(afd: Mapping[str, Any], key: str, **flags: Any) -> dict[str, Any]:
    """``afd[key]`` (a mapping, or absent) with ``flags`` set over it."""
    section = afd.get(key) or {}
    if not isinstance(section, dict):
        raise ConfigError(f"afd.{key}", f"expected a mapping, got {type(section).__name__}")
    return {**section, **flags}


def _base_afd(opts: ServeOptions, from_extra: Mapping[str, Any]) -> dict[str, Any]:
    """The ``afd`` section every role shares: the extra args' section, then ``--afd``, then the flags."""
    base = from_extra.get(AFD_KEY, {})
    if not isinstance(base, dict):
        raise ConfigError("afd", f"expected a mapping, got {type(base).__name__}")
    afd = dict(base)
    if opts.afd_json is not None:
        afd.update(json_object(opts.afd_json, "--afd"))
    ranks = opts.attention * opts.attention_tp
    flags = [("num_attention_ranks", "--attention x --attention-tp", ranks), ("num_ffn_ranks", "--ffn", opts.ffn)]
    flags.append((GROUP_KEY, "--attention / --attention-groups x --attention-tp", ranks // opts.attention_groups))
    if opts.expert_replicas is not None:
        flags.append(("expert_replicas", "--expert-replicas", opts.expert_replicas))
    for key, flag, value in flags:
        if key in afd and afd[key] != value:
            raise ConfigError(f"afd.{key}", f"{afd[key]!r} conflicts with {flag} {value}")
        afd[key] = value
    for key in ("role", RANK_KEY):
        if key in afd:
            raise ConfigError(f"afd.{key}", "set per process by afd-mrv2 serve; leave it out")
    if opts.connector is not None:
        afd["connector"] = opts.connector
    afd.setdefault("connector", DEFAULT_CONNECTOR)
    if opts.transport is not None:
        afd["transport"] = opts.transport
    if opts.depth is not None:
        afd["multistream"] = _with_flags(afd, "multistream", enabled=True, depth=_depth_value(opts.depth))
    if opts.ubatches is not None:
        afd["ubatch"] = _with_flags(afd, "ubatch", num_ubatches=opts.ubatches)
    _store_where(afd, opts)
    return afd


def deployment_secret(opts: ServeOptions, transport: str) -> bytes | None:
    """The deployment's secret: ``--secret-file``'s content (every node is given the same file); on one node
    without it a fresh one (none for gloo pairs, which it cannot guard).  Over several nodes the file is
    required and gloo refused: one line each."""
    secret: bytes | None
    if opts.secret_file is not None:
        try:
            secret = Path(opts.secret_file).read_bytes().strip()
        except OSError as exc:
            raise AfdError(f"--secret-file {opts.secret_file}: {exc.strerror or exc}") from None
        if len(secret) < 16:
            raise AfdError(f"--secret-file {opts.secret_file}: {len(secret)} bytes; give at least 16")
    elif opts.nodes.multi:
        raise AfdError(
            f"--nnodes {opts.nodes.nnodes} needs --secret-file: a file every node is given (e.g. made with "
            "'head -c 32 /dev/urandom | xxd -p > FILE'); only processes with it join the deployment"
        )
    else:
        secret = secrets.token_bytes(32) if transport != "gloo" else None
    if secret is not None and transport == "gloo":
        raise AfdError("afd.transport gloo cannot be guarded by the deployment's secret: use tcp or zmq")
    return secret


def _store_where(afd: dict[str, Any], opts: ServeOptions) -> None:
    """Where the rendezvous store listens: serve's own (node 0's over several nodes), unless the section says."""
    afd.setdefault("rendezvous", "external")  # the supervisor hosts the store: restarted roles rejoin
    afd.setdefault("host", opts.nodes.store_host())
    afd.setdefault("port", opts.nodes.master_port or opts.port + opts.attention + 1)
    afd.setdefault("join_timeout_s", opts.ready_timeout_s)  # an engine waits for its FFN ranks as long as serve does
    moved = opts.nodes.master_port is not None and afd["port"] != opts.nodes.master_port
    if opts.nodes.multi and (afd["rendezvous"] != "external" or afd["host"] != opts.nodes.master_addr or moved):
        raise AfdError(
            f"over --nnodes {opts.nodes.nnodes} the rendezvous store is node 0's, on --master-addr: leave "
            "afd.rendezvous, afd.host and afd.port out"
        )


def _check_own_keys_unset() -> None:
    """Refuse ``$AFD_MRV2_ADDITIONAL_CONFIG`` in serve's own environment: every role's process inherits serve's
    environment over the one serve gives it, so one value would reach every role, where serve hands each role
    its own ``afd`` section (in the variable itself on vLLM-Ascend)."""
    if envs.additional_config() is not None:
        raise AfdError(
            f"{envs.ADDITIONAL_CONFIG.name} is set in serve's environment: serve hands each role its own afd "
            f"section; unset it and pass the section with --afd or --additional-config after --"
        )


def core_blocks(count: int, cores: Sequence[int]) -> list[tuple[int, ...]]:
    """The cores of each of ``count`` processes: disjoint blocks of ``cores`` when there are enough of them,
    else one core each, round robin (none: empty blocks)."""
    cores = sorted(cores)
    if not cores:
        return [()] * count
    if len(cores) < count:
        return [(cores[i % len(cores)],) for i in range(count)]
    size = len(cores) // count
    return [tuple(cores[i * size : (i + 1) * size]) for i in range(count)]


#: vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` value for "bind nothing"
UNBOUND = "nobind"


def _core_layout(
    local: Sequence[tuple[str, int, int]], cores: Sequence[int]
) -> dict[tuple[str, int], list[tuple[int, ...]] | None]:
    """Each local role rank's core blocks, one per process (:func:`core_blocks`; Attention processes first).

    With fewer cores than processes the FFN ranks get None: no core of their own.  Pinned to a core an Attention
    process also has, an FFN rank starves: a tensor-parallel rank that got its combine first spins in vLLM's shm
    all-reduce on that core while the FFN still has to send its TP peer's combine (measured: DP1 TP2 with one FFN
    rank on 2 cores stalled at start in 4 starts of 4 pinned and 2 of 2 under vLLM's own binding, started in 3 of
    3 left to the scheduler).
    """
    processes = sum(n for _, _, n in local)
    pinned = [p for p in local if p[0] == ATTENTION or len(cores) >= processes]
    blocks = iter(core_blocks(sum(n for _, _, n in pinned), cores))
    layout: dict[tuple[str, int], list[tuple[int, ...]] | None] = {(role, r): None for role, r, _ in local}
    layout.update({(role, r): [next(blocks) for _ in range(n)] for role, r, n in pinned})
    return layout


def cpu_binds(count: int, cores: Sequence[int]) -> list[str]:
    """:func:`core_blocks` as ``VLLM_CPU_OMP_THREADS_BIND`` values."""
    return [",".join(map(str, block)) for block in core_blocks(count, cores)]


def _available_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def check_model_folder(model: str) -> None:
    """Refuse a model that names a local folder which does not exist (an absolute or ``./`` path, ``~``, or
    more than one ``/``: never a Hugging Face ``org/name`` repository id) or lacks ``config.json``."""
    path = Path(model).expanduser()
    local = path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1
    if local and not path.is_dir():
        raise AfdError(f"model folder {model} does not exist")
    if path.is_dir() and not (path / "config.json").is_file():
        raise AfdError(f"model folder {model} has no config.json (a Hugging Face checkpoint folder has one)")


def _check_topology(opts: ServeOptions) -> None:
    """The counts of the command line, and the layout flags that must not go to every role; one line each."""
    if opts.attention < 1 or opts.ffn < 1:
        raise AfdError(f"--attention and --ffn must be >= 1, got {opts.attention} and {opts.ffn}")
    if opts.attention_groups < 1 or opts.attention % opts.attention_groups:
        raise AfdError(
            f"--attention-groups must divide --attention ({opts.attention}) into groups of equal size, "
            f"got {opts.attention_groups}"
        )
    if opts.attention_tp < 1:
        raise AfdError(f"--attention-tp must be >= 1, got {opts.attention_tp}")
    if not 1 <= opts.port <= 65535 - opts.attention - 1:
        raise AfdError(f"--port must leave room for {opts.attention} engine ports above it, got {opts.port}")
    given = [flag for flag in GROUP_FLAGS for arg in opts.extra if arg == flag or arg.startswith(flag + "=")]
    if given:
        raise AfdError(
            f"{given[0]} after -- would reach every role, the FFN ranks too: lay the Attention role out with "
            "--attention (DP ranks), --attention-groups and --attention-tp"
        )


def _processes(opts: ServeOptions) -> list[tuple[str, int, int]]:
    """``(role, rank, processes)`` of every role rank, Attention groups first (each group's DP x TP processes)."""
    per_group = opts.attention // opts.attention_groups * opts.attention_tp
    return [(ATTENTION, g, per_group) for g in range(opts.attention_groups)] + [(FFN, f, 1) for f in range(opts.ffn)]


def build_plan(opts: ServeOptions, commands: RoleCommands | None = None, run_dir: str | None = None) -> Plan:
    """Validate everything and lay out the processes; raises :class:`AfdError` (one line) on bad input."""
    _check_topology(opts)
    opts.nodes.check()
    layout = Layout.spread(opts.attention_groups, opts.ffn, opts.nodes.nnodes, opts.nodes.layout)
    from_extra, extra = split_additional_config(opts.extra)
    afd = _base_afd(opts, from_extra)
    _check_own_keys_unset()
    for role in (ATTENTION, FFN):  # the CONFIG admission checks each role's process will run
        run(Subject({**afd, "role": role}), (Stage.CONFIG,))
    num_experts = _resolve_placement(afd, opts.model)
    addr = opts.nodes.address(int(afd["port"]))
    secret = deployment_secret(opts, str(afd.get("transport", "tcp")))
    # created by the supervisor when it starts (nothing is written before the checks passed)
    run_dir = run_dir or str(Path(tempfile.gettempdir()) / f"afd-mrv2-serve-{os.getpid()}")
    here = opts.nodes.node_rank
    local = [(role, r, n) for role, r, n in _processes(opts) if layout.node_of(role, r) == here]
    cores = _core_layout(local, _available_cores())
    where = _Where(afd, from_extra, extra, run_dir, addr, commands or RoleCommands(), own_keys_in_env(), secret)
    specs = [
        _role_spec(opts, where, role, rank, layout.node_of(role, rank), cores.get((role, rank)))
        for role, count in ((FFN, opts.ffn), (ATTENTION, opts.attention_groups))
        for rank in range(count)
    ]
    return Plan(opts, tuple(specs), run_dir, afd, num_experts, here, addr, layout, secret)


@dataclass(frozen=True)
class _Where:
    """What every role spec of one node's plan is built from."""

    afd: dict[str, Any]
    from_extra: dict[str, Any]
    extra: tuple[str, ...]
    run_dir: str
    addr: str
    commands: RoleCommands
    #: on vLLM-Ascend afd-mrv2's keys travel in each role's environment
    in_env: bool
    secret: bytes | None


def _role_spec(
    opts: ServeOptions, where: _Where, role: str, rank: int, node: int, blocks: Sequence[tuple[int, ...]] | None
) -> RoleSpec:
    """One role rank's spec (an Attention group's: its first AFD rank in its section, one core block per process;
    None: left to the scheduler, :func:`_core_layout`): its own ``afd`` section, environment, port and command
    line; another node's role gets its section and port only (that node builds the rest)."""
    first = rank * int(where.afd[GROUP_KEY]) if role == ATTENTION else rank
    section = {**where.afd, "role": role, RANK_KEY: first}
    parse_afd_config(section)  # rank below its role's count
    port = opts.port + 1 + rank if role == ATTENTION else None
    if node != opts.nodes.node_rank:
        return RoleSpec(role, rank, (), section, port, node=node, host="")
    additional, own_env = place_own_keys(where.from_extra, {AFD_KEY: section}, in_env=where.in_env)
    env = {**ROLE_ENV, envs.STATS_DIR.name: where.run_dir, **own_env}  # STATS_DIR: its live figures (/metrics)
    if where.secret is not None:
        env[envs.SECRET.name] = where.secret.hex()
    if role == ATTENTION and opts.ubatches is not None:
        env[envs.V2_MODEL_RUNNER.name] = "1"
    if blocks is None:  # not pinned, and vLLM binds nothing either (its "auto" would pin the worker)
        env[CPU_BIND_ENV], blocks = UNBOUND, []
    elif any(blocks):  # one entry per process (vLLM slices it by DP rank, then TP rank)
        env[CPU_BIND_ENV] = "|".join(",".join(map(str, block)) for block in blocks)
    cores = tuple(sorted({c for block in blocks for c in block})) if CPU_BIND_ENV not in os.environ else ()
    ready = str(Path(where.run_dir) / f"ffn-{rank}.ready") if role == FFN else None
    attention = role == ATTENTION
    ctx = RoleContext(
        model=opts.model,
        role=role,
        rank=rank,
        port=port,
        additional_config=json.dumps(additional, sort_keys=True),
        extra=where.extra,
        ready_file=ready,
        ubatches=opts.ubatches if attention else None,
        host=where.addr,
        dp_size=opts.attention // opts.attention_groups if attention else 1,
        tp_size=opts.attention_tp if attention else 1,
    )
    build = where.commands.attention if attention else where.commands.ffn
    return RoleSpec(role, rank, tuple(build(ctx)), section, port, ready, env, cores, node, where.addr)


def _resolve_placement(afd: dict[str, Any], model: str) -> int | None:
    """Where the model's ``config.json`` gives its routed-expert count: write the resolved placement table
    (``afd.placement``, the ring's by default) into ``afd``, the section every role gets; returns the count
    (None: unknown here, each role resolves the same table from its model, and the pairs' handshake checks)."""
    facts = checkpoint_facts(model)
    if facts is None or facts.num_experts <= 0:
        return None
    config = parse_afd_config({**afd, "role": FFN})
    afd["placement"] = config.placement_for(facts.num_experts).table()
    return facts.num_experts
