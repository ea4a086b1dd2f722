#!/usr/bin/env bash
# Set up a fresh Debian machine (as root) for ghostgpu, then run the main job or the tests.
#   bash scripts/bootstrap.sh run [ARGS...]   # install what is missing, then `ghostgpu up ARGS...`
#   bash scripts/bootstrap.sh test [PYTEST ARGS...]  # install what is missing, then the whole test suite
#   bash scripts/bootstrap.sh install         # install only
# Idempotent: every step checks before it acts, so a second run takes a second or two.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${GHOSTGPU_VENV:-$here/.venv}"
log() { printf 'bootstrap: %s\n' "$*" >&2; }

need_root() {
  if [ "$(id -u)" != 0 ]; then
    log "must run as root (bcc loads BPF programs and the tests make namespaces); try: sudo bash $0 $*"
    exit 1
  fi
}

apt_install() {
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

link_kernel_headers() {
  # bcc wants /lib/modules/$(uname -r)/{build,source}. Distro kernels ship matching headers; custom
  # kernels (this VM's 6.18) do not. Our BPF reads only tracepoint arguments and helper results, never
  # kernel structs, so the newest installed Debian headers are safe to compile against. Debian splits
  # them: -amd64 holds the generated config (build), -common the sources (source).
  local mod="/lib/modules/$(uname -r)"
  [ -e "$mod/build/include/generated" ] && [ -e "$mod/source/include/linux/kconfig.h" ] && return 0
  local arch common
  arch="$(ls -d /usr/src/linux-headers-*-amd64 /usr/src/linux-headers-*-arm64 2>/dev/null | sort -V | tail -n 1 || true)"
  if [ -z "$arch" ]; then log "no kernel headers under /usr/src; install linux-headers-amd64"; exit 1; fi
  common="${arch%-*}-common"
  [ -d "$common" ] || common="$arch"
  mkdir -p "$mod"
  ln -sfn "$arch" "$mod/build"
  ln -sfn "$common" "$mod/source"
  log "linked $mod/build -> $arch, $mod/source -> $common"
}

mount_tracefs() {
  # bcc compiles tracepoint probes against /sys/kernel/tracing/events/*/format.
  if [ ! -e /sys/kernel/tracing/events ]; then
    mount -t tracefs tracefs /sys/kernel/tracing
  fi
}

make_venv() {
  if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv (system site packages, for bcc)"
    /usr/bin/python3 -m venv --system-site-packages "$venv"
  fi
  local stamp="$venv/.ghostgpu-installed"
  if [ ! -f "$stamp" ] || [ "$here/pyproject.toml" -nt "$stamp" ]; then
    log "pip install -e .[dev]"
    "$venv/bin/pip" install -q --disable-pip-version-check -e "$here[dev]"
    touch "$stamp"
  fi
  ln -sfn "$venv/bin/ghostgpu" /usr/local/bin/ghostgpu
}

install() {
  need_root "$@"
  apt_install python3-bpfcc python3-venv python3-dev linux-headers-amd64 gcc make psmisc lsof util-linux iproute2 strace \
    containerd runc busybox-static prometheus prometheus-alertmanager python3-yaml chromium
  command -v npm >/dev/null || apt_install npm  # tests/integration/test_speedscope.py installs the viewer
  link_kernel_headers
  mount_tracefs
  make_venv
}

cmd="${1:-run}"; shift || true
case "$cmd" in
  install) install ;;
  run) install; exec "$venv/bin/ghostgpu" up "$@" ;;
  test) install; cd "$here"; exec "$venv/bin/python" -m pytest "$@" ;;
  *) log "usage: bootstrap.sh run|test|install"; exit 2 ;;
esac
