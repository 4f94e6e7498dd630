"""``python serve_harness.py SERVE-ARGS...``: ``afd-mrv2 serve`` with fake roles and no runtime gate.

The role commands are the only difference from the real command: both start
:mod:`fake_role` (next to this file) with the role, rank, port, ready file and
``--additional-config`` serve built, then the EXTRA VLLM ARGS.
"""

from __future__ import annotations

import sys
from pathlib import Path

from afd_mrv2.cli.serve import main
from afd_mrv2.serve import RoleCommands, RoleContext

FAKE = str(Path(__file__).with_name("fake_role.py"))


def fake_command(ctx: RoleContext) -> list[str]:
    argv = [sys.executable, FAKE, ctx.role, str(ctx.rank), "--additional-config", ctx.additional_config]
    if ctx.port is not None:
        argv += ["--port", str(ctx.port), "--host", ctx.host]
    if ctx.ready_file is not None:
        argv += ["--ready-file", ctx.ready_file]
    return [*argv, *ctx.extra]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], commands=RoleCommands(attention=fake_command, ffn=fake_command), gate=None))
