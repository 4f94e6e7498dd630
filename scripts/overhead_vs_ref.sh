#!/usr/bin/env bash
# Per-item executor overhead (no-op hooks) of this tree and of git REF, measured side by side:
# rounds alternate between the two trees so machine noise hits both alike.
# Usage: scripts/overhead_vs_ref.sh REF [ROUNDS]   (run from the repository root, venv active)
set -euo pipefail
ref=${1:?usage: scripts/overhead_vs_ref.sh REF [ROUNDS]}
rounds=${2:-5}
root=$(pwd)
old=$(mktemp -d)
git worktree add -q --detach "$old" "$ref"
trap 'git worktree remove --force "$old"' EXIT
probe='
import json, sys
from afd_mrv2.bench.overhead import per_item_us
names = {False: "serialized", True: "pipelined"}
print(json.dumps({b + " " + names[p]: per_item_us(b, pipelined=p, items=2000)
                  for b in ("recording", "host") for p in (False, True)}))
'
results_old=(); results_new=()
for i in $(seq "$rounds"); do
  results_old+=("$(PYTHONPATH="$old" python -c "$probe")")
  results_new+=("$(PYTHONPATH="$root" python -c "$probe")")
done
python - "$ref" "${results_old[@]}" --- "${results_new[@]}" <<'PY'
import json, statistics, sys
ref, rest = sys.argv[1], sys.argv[2:]
cut = rest.index("---")
old = [json.loads(x) for x in rest[:cut]]
new = [json.loads(x) for x in rest[cut + 1:]]
print(f"{'backend/schedule':<22} {ref[:10] + ' us/item':>16} {'this tree us/item':>18} {'ratio':>7}")
for key in old[0]:
    a = statistics.median(r[key] for r in old)
    b = statistics.median(r[key] for r in new)
    print(f"{key:<22} {a:>16.1f} {b:>18.1f} {b / a:>7.3f}")
PY
