"""The one serving harness: start plain vLLM and ``afd-mrv2 serve``, ask them, compare their answers.

* :mod:`.servers`: :class:`PlainServer`, :class:`ServeServer` (and its :class:`ServeTopology`),
  child process groups that never outlive their caller;
* :mod:`.client`: OpenAI completions, greedy answers and their comparison, ``collective_rpc``;
* :mod:`.host`: the scripts' errors and exit contract (:func:`guarded`), input checks, the
  process tree in /proc and its CPU time.

Used by ``afd-mrv2 probe ascend``, the repository's scripts (through ``scripts/serving``) and tests/vllm.
"""

from .client import (
    DEV_MODE,
    PROMPTS,
    Greedy,
    LineReader,
    Round,
    body,
    collective_rpc,
    compare,
    complete,
    complete_all,
    engine_steps,
    greedy,
    prompts,
    run_requests,
    stream,
)
from .host import (
    BIND_ENV,
    ServerError,
    UsageError,
    check_model,
    check_vllm,
    count_cores,
    cpu_seconds,
    guarded,
    load_average,
    parse_cpu_list,
    process_cpu,
    role_binds,
    write_json,
)
from .servers import (
    BASE_ENV,
    ENGINE_ARGS,
    READY,
    START_TIMEOUT_S,
    Child,
    FfnDone,
    PlainServer,
    ServeServer,
    ServeTopology,
    ffn_reports,
    wait_health,
)

__all__ = [
    "BASE_ENV",
    "BIND_ENV",
    "DEV_MODE",
    "ENGINE_ARGS",
    "PROMPTS",
    "READY",
    "START_TIMEOUT_S",
    "Child",
    "FfnDone",
    "Greedy",
    "LineReader",
    "PlainServer",
    "Round",
    "ServeServer",
    "ServeTopology",
    "ServerError",
    "UsageError",
    "body",
    "check_model",
    "check_vllm",
    "collective_rpc",
    "compare",
    "complete",
    "complete_all",
    "count_cores",
    "cpu_seconds",
    "engine_steps",
    "ffn_reports",
    "greedy",
    "guarded",
    "load_average",
    "parse_cpu_list",
    "process_cpu",
    "prompts",
    "role_binds",
    "run_requests",
    "stream",
    "wait_health",
    "write_json",
]
