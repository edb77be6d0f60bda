# Debian chroots for the checks that need another system than this one: the GPU
# kit in a bare Debian 12 (scripts/check-gpu-kit), the Python suite under the
# torch 2.x of Debian testing (scripts/test-torch2). Sourced, not run; needs
# root, and debootstrap (installed with apt-get when missing).
#
#   chroot_rootfs CACHE SUITE PACKAGE...
#     Makes (once) CACHE/SUITE/rootfs: `debootstrap --variant=minbase SUITE`
#     plus PACKAGEs (no recommends). Reused while its package list is the same;
#     sets CHROOT_ROOTFS. Downloads the first time, from this machine's apt
#     mirror (scripts/lib/debian_mirror.sh; ACTSTASH_DEBIAN_MIRROR overrides).
#   chroot_enter LOWER SCRATCH
#     Mounts a writable overlay of LOWER at SCRATCH/root (changes go to
#     SCRATCH/upper, dropped on exit) with /proc, read-only /sys, /dev,
#     /dev/pts, and tmpfs /dev/shm and /tmp; sets CHROOT_ROOT.
#   chroot_bind SOURCE TARGET [ro]
#     Bind-mounts SOURCE at CHROOT_ROOT/TARGET (created), read-only with ro.
#   chroot_cleanup
#     Kills what still runs in CHROOT_ROOT and unmounts everything mounted, in
#     reverse order, and drops the overlay's changes unless CHROOT_KEEP=1.
#     chroot_traps makes it run on exit, on SIGINT and on SIGTERM.
#   chroot_check_unmounted DIR
#     Fails when something is still mounted under DIR (a run killed with
#     SIGKILL): removing DIR then would reach into the mounts.

# shellcheck source=scripts/lib/debian_mirror.sh
. "$(dirname "${BASH_SOURCE[0]}")/debian_mirror.sh"

CHROOT_MOUNTS=()
CHROOT_ROOT=""
CHROOT_ROOTFS=""
CHROOT_SCRATCH=""
CHROOT_PARTIAL=""  # a root filesystem being made

chroot_mount() {  # chroot_mount TARGET MOUNT-ARGS...: mount and remember
  local target=$1
  shift
  mount "$@" "$target"
  CHROOT_MOUNTS+=("$target")
}

chroot_rootfs() {
  local cache=$1 suite=$2
  shift 2
  local packages="$*" dir=$cache/$suite marker=.actstash-chroot
  CHROOT_ROOTFS=$dir/rootfs
  if [ -f "$CHROOT_ROOTFS/$marker" ] && [ "$(cat "$CHROOT_ROOTFS/$marker")" = "$packages" ]; then
    echo "chroot: $suite root filesystem cached ($CHROOT_ROOTFS)"
    return 0
  fi
  if ! command -v debootstrap > /dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap
  fi
  echo "chroot: debootstrap --variant=minbase $suite, then: $packages"
  local partial=$dir/rootfs.partial
  chroot_check_unmounted "$dir" || return 1
  CHROOT_PARTIAL=$(realpath -m "$partial")
  rm -rf "$CHROOT_ROOTFS" "$partial"
  mkdir -p "$dir"
  debootstrap --variant=minbase "$suite" "$partial" "$(debian_mirror)"
  cp /etc/resolv.conf "$partial/etc/resolv.conf"
  chroot_mount "$partial/proc" -t proc proc
  chroot_mount "$partial/dev/pts" -t devpts -o newinstance,ptmxmode=0666 devpts
  # A rolling suite's Release file may carry a Valid-Until already past against
  # this machine's clock; the packages are still the suite's signed ones.
  chroot "$partial" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
    DEBIAN_FRONTEND=noninteractive sh -c \
    "apt-get -o Acquire::Check-Valid-Until=false update -q &&
     apt-get install -y -q --no-install-recommends $packages && apt-get clean"
  umount "$partial/dev/pts" "$partial/proc"
  unset 'CHROOT_MOUNTS[-1]' 'CHROOT_MOUNTS[-1]'
  echo "$packages" > "$partial/$marker"
  mv "$partial" "$CHROOT_ROOTFS"
  CHROOT_PARTIAL=""
}

chroot_enter() {
  local lower=$1
  mkdir -p "$2"
  # Physical: cleanup finds the processes inside by /proc/PID/root, which is.
  CHROOT_SCRATCH=$(cd "$2" && pwd -P)
  CHROOT_ROOT=$CHROOT_SCRATCH/root
  mkdir -p "$CHROOT_SCRATCH/upper" "$CHROOT_SCRATCH/ovl-work" "$CHROOT_ROOT"
  chroot_mount "$CHROOT_ROOT" -t overlay overlay \
    -o "lowerdir=$lower,upperdir=$CHROOT_SCRATCH/upper,workdir=$CHROOT_SCRATCH/ovl-work"
  chroot_mount "$CHROOT_ROOT/proc" -t proc proc
  chroot_mount "$CHROOT_ROOT/sys" -t sysfs -o ro sysfs
  chroot_mount "$CHROOT_ROOT/dev" --bind /dev
  mount --make-rslave "$CHROOT_ROOT/dev"
  chroot_mount "$CHROOT_ROOT/dev/pts" -t devpts -o newinstance,ptmxmode=0666 devpts
  chroot_mount "$CHROOT_ROOT/dev/shm" -t tmpfs -o mode=1777,size=2g shm
  chroot_mount "$CHROOT_ROOT/tmp" -t tmpfs -o mode=1777 tmp
}

chroot_bind() {
  local source=$1 target=$CHROOT_ROOT$2
  mkdir -p "$target"
  chroot_mount "$target" --bind "$source"
  if [ "${3:-}" = ro ]; then
    mount -o remount,bind,ro "$target"
  fi
}

chroot_cleanup() {
  set +e
  local pid i root
  for root in "$CHROOT_ROOT" "$CHROOT_PARTIAL"; do
    [ -n "$root" ] || continue
    for pid in /proc/[0-9]*; do
      [ "$(readlink "$pid/root" 2>/dev/null)" = "$root" ] && kill -KILL "${pid#/proc/}" 2>/dev/null
    done
  done
  for ((i = ${#CHROOT_MOUNTS[@]} - 1; i >= 0; i--)); do
    umount "${CHROOT_MOUNTS[$i]}" 2>/dev/null || umount -l "${CHROOT_MOUNTS[$i]}"
  done
  CHROOT_MOUNTS=()
  if [ -n "$CHROOT_SCRATCH" ] && [ "${CHROOT_KEEP:-0}" != 1 ]; then
    rm -rf "$CHROOT_SCRATCH/upper" "$CHROOT_SCRATCH/ovl-work"
    rmdir "$CHROOT_ROOT" 2>/dev/null
  fi
  return 0
}

chroot_traps() {
  trap chroot_cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
}

chroot_check_unmounted() {
  local dir
  dir=$(realpath -m "$1")
  if awk -v d="$dir/" 'index($2 "/", d) == 1 { found = 1 } END { exit !found }' /proc/mounts; then
    echo "chroot: still mounted under $dir (a run that was killed): unmount first:" >&2
    awk -v d="$dir/" 'index($2 "/", d) == 1 { print "  " $2 }' /proc/mounts >&2
    return 1
  fi
}
