#!/usr/bin/env bash
# What `scripts/setup --packages` costs a fresh Debian 12 machine: in a bare
# bookworm chroot (debootstrap --variant=minbase, scripts/lib/chroot.sh), the
# packages of each PURPOSE of scripts/debian-packages.txt are installed as
# scripts/setup installs them (apt-get update, then install with no
# recommends), on a fresh overlay each time; printed per purpose: the
# packages asked for, the packages apt installed, the seconds apt took
# (update + download + unpack), the MiB downloaded and the MiB the root
# filesystem grew by (the overlay's upper layer, downloads removed).
#
#   bench/setup_cost.sh [--list FILE] [--full] PURPOSE...
#     e.g. bench/setup_cost.sh all ci
#     --list FILE: another package list (e.g. an older commit's, through
#     `git show COMMIT:scripts/debian-packages.txt > FILE`)
#     --full: then, in the same chroot, a clone of this repository's HEAD
#     runs the README's two commands, `scripts/setup` and `scripts/test`,
#     with an empty compiler cache and no CUDA: their seconds, whether they
#     passed, and the MiB the clone (build included) takes
#
# Needs root and network access to this machine's Debian mirror.
# Cache: ACTSTASH_SETUP_COST_CACHE (default /var/tmp/actstash-setup-cost).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/chroot.sh
. scripts/lib/chroot.sh
[ "$(id -u)" -eq 0 ] || { echo "setup_cost: run as root (debootstrap, mounts, chroot)" >&2; exit 2; }
list=scripts/debian-packages.txt
full=0
while [ $# -gt 0 ]; do
  case "$1" in
    --list) list=$2; shift 2 ;;
    --full) full=1; shift ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
cache=${ACTSTASH_SETUP_COST_CACHE:-/var/tmp/actstash-setup-cost}
chroot_traps
chroot_rootfs "$cache" bookworm ca-certificates
base=$(du -sxm "$CHROOT_ROOTFS" | cut -f1)
printf '%-8s %8s %9s %9s %13s %12s\n' purpose asked installed apt_s downloaded_MiB grown_MiB
for purpose in "$@"; do
  mapfile -t packages < <(ACTSTASH_PACKAGES_FILE=$list sh scripts/packages "$purpose")
  [ ${#packages[@]} -gt 0 ] || { echo "setup_cost: no packages for purpose $purpose" >&2; exit 1; }
  scratch=$cache/run-$purpose
  chroot_check_unmounted "$scratch"
  rm -rf "$scratch"
  chroot_enter "$CHROOT_ROOTFS" "$scratch"
  start=$(date +%s.%N)
  chroot "$CHROOT_ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
    DEBIAN_FRONTEND=noninteractive sh -c \
    "apt-get -o Acquire::Check-Valid-Until=false update -q > /dev/null &&
     apt-get install -y -q --no-install-recommends ${packages[*]} > /var/log/setup-cost.log 2>&1" ||
    { tail -20 "$CHROOT_ROOT/var/log/setup-cost.log" >&2; exit 1; }
  end=$(date +%s.%N)
  installed=$(grep -c '^Unpacking ' "$CHROOT_ROOT/var/log/setup-cost.log" || true)
  downloaded=$(du -sm "$CHROOT_ROOT/var/cache/apt/archives" | cut -f1)
  chroot "$CHROOT_ROOT" apt-get clean
  rm -rf "$CHROOT_ROOT/var/lib/apt/lists/"*
  grown=$(du -sxm "$scratch/upper" | cut -f1)
  printf '%-8s %8d %9d %9.0f %13d %12d\n' "$purpose" "${#packages[@]}" "$installed" \
    "$(awk -v a="$start" -v b="$end" 'BEGIN { print b - a }')" "$downloaded" "$grown"
  if [ "$full" = 1 ]; then
    git clone -q "$PWD" "$CHROOT_ROOT/root/actstash"
    for step in setup test; do
      start=$(date +%s)
      rc=0
      chroot "$CHROOT_ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
        ACTSTASH_CCACHE_DIR=/root/ccache sh -c "cd /root/actstash && scripts/$step" \
        > "$cache/full-$purpose-$step.log" 2>&1 || rc=$?
      echo "$purpose: scripts/$step exit $rc in $(( $(date +%s) - start )) s" \
        "(log: $cache/full-$purpose-$step.log)"
      [ "$rc" = 0 ] || break
    done
    echo "$purpose: the clone with its build: $(du -sxm "$CHROOT_ROOT/root/actstash" | cut -f1) MiB," \
      "the compiler cache $(du -sxm "$CHROOT_ROOT/root/ccache" 2>/dev/null | cut -f1) MiB"
  fi
  chroot_cleanup
done
echo "setup_cost: base root filesystem (minbase + ca-certificates) $base MiB"
