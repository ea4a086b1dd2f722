#!/usr/bin/env bash
# The README's first-run figure: `bash scripts/bootstrap.sh run --demo --once` on a fresh Debian 12
# root (mmdebstrap minbase plus git, python3, curl), the repository cloned to /root/ghostgpu (a 0700
# home, as a newcomer's clone is), run twice (the second run shows what an idempotent rerun costs).
# The root is entered with pivot_root in a mount namespace of its own, as a fresh machine or a
# container is. Writes bench/results/first_run.json: each run's wall time, its exit status, its step lines, and the
# size of the finished root. Needs root and the network to Debian's and PyPI's mirrors.
#   bash bench/first_run.sh [ROOT_DIR]     # default /srv/ghostgpu-first-run (removed first)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root="${1:-/srv/ghostgpu-first-run}"
out="$here/bench/results/first_run.json"
[ "$(id -u)" = 0 ] || { echo "first_run.sh: needs root (mmdebstrap, chroot, mounts)" >&2; exit 1; }
command -v mmdebstrap >/dev/null || { echo "first_run.sh: apt-get install mmdebstrap" >&2; exit 1; }

rm -rf "$root"
mmdebstrap --quiet --variant=minbase --include=git,python3,curl,ca-certificates bookworm "$root"
# This machine's package sources and pip settings, so the chroot reaches the same mirrors.
cp -a /etc/apt/apt.conf.d/. "$root/etc/apt/apt.conf.d/" 2>/dev/null || true
[ -f /etc/pip.conf ] && cp /etc/pip.conf "$root/etc/pip.conf"
# A proxy's CA, if this machine trusts one: the bundle now, and its source for any later rebuild.
cp -a /usr/local/share/ca-certificates/. "$root/usr/local/share/ca-certificates/"
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
git clone -q "$here" "$root/root/ghostgpu"

# One run as JSON: its exit status, wall time and the step lines bootstrap printed.
run_json() {
  python3 -c '
import json, sys
lines = open(sys.argv[1], encoding="utf-8", errors="replace").read().splitlines()
steps = [line for line in lines if line.startswith(("[", "bootstrap:"))]
print(json.dumps({"exit": int(sys.argv[2]), "wall_s": round(float(sys.argv[3]), 1), "steps": steps}))
' "$@"
}

runs=()
for attempt in 1 2; do
  log="$(mktemp)"
  # A private mount namespace whose root is the new root (pivot_root, as a container or a machine
  # has; a plain chroot leaves the host's root above it, and then the demo's devices, in mount
  # namespaces of their own, read as <root>/dev/nvidia0 in /proc: outside the device prefixes).
  # /proc, /sys and /dev for it vanish with the namespace.
  started_ns=$(date +%s%N)
  set +e
  unshare --mount --fork bash -c '
    set -e
    root=$1
    mount --make-rprivate /
    mount --bind "$root" "$root"
    mount -t proc proc "$root/proc"
    mount --rbind /sys "$root/sys"
    mount --rbind /dev "$root/dev"
    mkdir -p "$root/.oldroot"
    cd "$root"
    pivot_root . .oldroot
    umount -l /.oldroot
    exec /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      HOME=/root TERM=dumb bash -c "cd /root/ghostgpu && bash scripts/bootstrap.sh run --demo --once"
  ' _ "$root" >"$log.out" 2>"$log"
  rc=$?
  set -e
  wall_s=$(( ($(date +%s%N) - started_ns) / 1000000 ))e-3
  echo "run $attempt: exit $rc in ${wall_s} s" >&2
  cat "$log" >&2
  runs+=("$(run_json "$log" "$rc" "$wall_s")")
  rm -f "$log" "$log.out"
done
size_mb=$(du -sm --exclude=proc --exclude=sys --exclude=dev "$root" | cut -f1)
cd "$here"
python3 - "$out" "$size_mb" "${runs[@]}" <<'EOF'
import json, sys
from bench.common import machine
out, size_mb, runs = sys.argv[1], int(sys.argv[2]), [json.loads(r) for r in sys.argv[3:]]
doc = {"what": "bootstrap.sh run --demo --once on a fresh Debian 12 minbase root, twice",
       "machine": machine(), "first": runs[0], "second": runs[1], "root_size_mb": size_mb}
with open(out, "w") as f:
    json.dump(doc, f, indent=2)
    f.write("\n")
print(f"first run {runs[0]['wall_s']} s (exit {runs[0]['exit']}), second {runs[1]['wall_s']} s, "
      f"root {size_mb} MB -> {out}")
EOF
