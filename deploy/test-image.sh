#!/usr/bin/env bash
# Builds the top-level Dockerfile without a Docker daemon and smoke-tests the
# image: its configuration (user, entrypoint, volume, healthcheck, stop
# signal); `actstashd --help`; a daemon started from the image with a spill
# tier (--spill-dir) and a metrics endpoint answering `actstash ping`/`stats`
# (also from outside, through the shared socket directory); `actstash verify`
# storing more than the pool so that objects go to disk and come back, every
# byte compared; /metrics showing those spill bytes; the image's HEALTHCHECK
# command; the mlock warning under a low memlock limit; a clean SIGTERM stop.
# CI runs it (.ci/run).
#
#   deploy/test-image.sh                  # the working tree, CPU-only image
#   deploy/test-image.sh --from-git HEAD  # a committed tree instead (git archive)
#   deploy/test-image.sh --cuda           # ACTSTASH_WITH_CUDA=ON (needs NVIDIA's apt repo)
#
# Needs root. Uses podman (`podman build --isolation=chroot`); installs podman
# and debootstrap with apt-get when missing. No registry is needed: the base
# images debian:bookworm and debian:bookworm-slim are made with debootstrap
# from this machine's apt mirror (ACTSTASH_DEBIAN_MIRROR overrides) and
# imported (once; they stay in podman's storage, and podman's layer cache
# keeps the package stage between runs). Containers run with `podman run`
# when that works here, else the image's filesystem is mounted (podman create
# + podman mount) and the binaries run under chroot as uid 10001.
#
# Environment: ACTSTASH_IMAGE (tag, default localhost/actstash:test),
# ACTSTASH_ROOTFS (debootstrap directory, default /var/tmp/actstash-bookworm-rootfs),
# ACTSTASH_MODE (auto | podman-run | chroot; default auto).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
# shellcheck source=scripts/lib/debian_mirror.sh
. scripts/lib/debian_mirror.sh

image=${ACTSTASH_IMAGE:-localhost/actstash:test}
rootfs=${ACTSTASH_ROOTFS:-/var/tmp/actstash-bookworm-rootfs}
mode=${ACTSTASH_MODE:-auto}
from_git=""
build_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --from-git) from_git=$2; shift 2 ;;
    --cuda) build_args+=(--build-arg ACTSTASH_WITH_CUDA=ON); shift ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "test-image.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

log() { echo "test-image.sh: $*"; }
fail() { echo "test-image.sh: FAIL: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || fail "run as root (podman image mounts and chroot need it)"

# --- tools -------------------------------------------------------------------
missing=()
command -v podman >/dev/null || missing+=(podman)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
log "$(podman --version)"

# --- base images -------------------------------------------------------------
# Imported under the names a pull would give them, so FROM debian:bookworm
# finds them in local storage (and --pull=never keeps podman off registries).
if podman image exists docker.io/library/debian:bookworm &&
   podman image exists docker.io/library/debian:bookworm-slim; then
  log "base images present"
else
  if [ ! -x "$rootfs/usr/bin/apt-get" ]; then
    log "debootstrap bookworm into $rootfs (a few minutes)"
    rm -rf "$rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" "$(debian_mirror)"
  fi
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
  log "importing $rootfs as debian:bookworm and debian:bookworm-slim"
  tar --numeric-owner -C "$rootfs" -c . |
    podman import --change 'CMD ["bash"]' - docker.io/library/debian:bookworm
  podman tag docker.io/library/debian:bookworm docker.io/library/debian:bookworm-slim
fi

# --- build -------------------------------------------------------------------
context=$repo
work=$(mktemp -d /var/tmp/actstash-test-image.XXXXXX)   # logs, inspect output
cleanup_dirs=("$work")
container="actstash-test-$$"
mnt=""
mounted=()
daemon_pid=""

cleanup() {
  set +e
  [ -n "$daemon_pid" ] && kill "$daemon_pid" 2>/dev/null
  podman rm -f "$container" >/dev/null 2>&1
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[$i]}" 2>/dev/null; done
  if [ -n "$mnt" ]; then podman umount "$container-fs" >/dev/null 2>&1; fi
  podman rm -f "$container-fs" >/dev/null 2>&1
  for dir in "${cleanup_dirs[@]}"; do rm -rf "$dir"; done
}
trap cleanup EXIT
if [ -n "$from_git" ]; then
  context=$(mktemp -d /var/tmp/actstash-context.XXXXXX)
  cleanup_dirs+=("$context")
  git -C "$repo" archive "$from_git" | tar -x -C "$context"
  cp "$repo/Dockerfile" "$repo/.dockerignore" "$context/"
  log "build context: git archive $from_git (+ the working tree's Dockerfile, .dockerignore)"
fi
# The build stage compiles through this machine's compiler cache
# (scripts/ccache's folder bound in): a rebuild compiles only what changed.
ccache_dir=$(scripts/ccache --get-config cache_dir 2>/dev/null || true)
if [ -n "$ccache_dir" ] && [ -d "$ccache_dir" ]; then
  build_args+=(--build-arg ACTSTASH_CCACHE=ON -v "$ccache_dir:/var/cache/actstash-ccache")
  log "compiler cache: $ccache_dir"
fi
log "podman build -> $image"
build_start=$(date +%s)
podman build --isolation=chroot --format docker --pull=never "${build_args[@]}" \
  -t "$image" -f "$context/Dockerfile" "$context"
log "built in $(( $(date +%s) - build_start )) s; $(podman image inspect --format '{{.Size}}' "$image") bytes"

# --- image configuration -------------------------------------------------------
podman image inspect "$image" > "$work/image-inspect.json"
/usr/bin/python3 - "$work/image-inspect.json" <<'PY'
import json, sys
image = json.load(open(sys.argv[1]))[0]
config = image["Config"]
def check(what, ok):
    print(f"test-image.sh: image {what}: {'ok' if ok else 'WRONG'}")
    if not ok:
        sys.exit(1)
check(f"user {config.get('User')!r}", config.get("User") == "10001:10001")
check(f"entrypoint {config.get('Entrypoint')}", config.get("Entrypoint") == ["/usr/local/bin/actstashd"])
check(f"volumes {sorted(config.get('Volumes') or {})}", "/run/actstash" in (config.get("Volumes") or {}))
# podman keeps the healthcheck of a docker-format image beside Config
health = config.get("Healthcheck") or image.get("Healthcheck") or {}
check(f"healthcheck {health.get('Test')}", "ping" in (health.get("Test") or []))
check(f"stop signal {config.get('StopSignal')}", config.get("StopSignal") == "SIGTERM")
PY

# --- run ---------------------------------------------------------------------
sockdir=$(mktemp -d /var/tmp/actstash-sock.XXXXXX)
cleanup_dirs+=("$sockdir")
chown 10001:10001 "$sockdir"
socket_in=/run/actstash/actstash.sock
host_cli=""
[ -x "$repo/build/tools/actstash" ] && host_cli="$repo/build/tools/actstash"

# Outside check: the socket directory is what trainers share.
outside_ping() {
  if [ -n "$host_cli" ]; then
    "$host_cli" --address "unix://$sockdir/actstash.sock" ping ||
      fail "the host's actstash cannot ping the daemon through $sockdir"
  fi
}

# The daemon under test: a 256 MiB pool, a spill tier in the image's spill
# directory, Prometheus metrics on a free loopback port.
pool_args=(--pool-size 256MiB --spill-dir /var/lib/actstash/spill)
metrics_port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
metrics_args=(--metrics-address "127.0.0.1:$metrics_port")
# More than the pool: the oldest objects must go to disk and come back.
verify_args=(verify --bytes 384MiB --object-size 16MiB --require-spill)

# /metrics, read from the host: the endpoint answers and counts the spill
# tier's writes and reads of the verify run.
check_metrics() {
  log "metrics: http://127.0.0.1:$metrics_port/metrics"
  /usr/bin/python3 - "$metrics_port" <<'PY' || fail "the metrics endpoint is missing or does not count the spill"
import re, sys, urllib.request
text = urllib.request.urlopen("http://127.0.0.1:%s/metrics" % sys.argv[1], timeout=5).read().decode()
def value(direction):
    m = re.search(r'^actstash_spill_io_bytes_total\{direction="%s"\} (\S+)$' % direction, text, re.M)
    return float(m.group(1)) if m else 0.0
written, read = value("write"), value("read")
print("test-image.sh: metrics: spill written %.0f bytes, read %.0f bytes" % (written, read))
sys.exit(0 if written > 0 and read > 0 else 1)
PY
}

run_with_podman() {
  log "podman run: actstashd --help"
  podman run --rm --pull=never --network=none "$image" --help | sed -n '1,3p'  # reads it all: no SIGPIPE
  log "podman run: daemon (256 MiB pool, spill tier, metrics, memlock unlimited)"
  podman run -d --name "$container" --pull=never --network=host --ulimit memlock=-1:-1 \
    -v "$sockdir:/run/actstash" "$image" --socket "$socket_in" "${pool_args[@]}" \
    "${metrics_args[@]}" --mlock on
  local up=""
  for _ in $(seq 60); do
    if podman exec "$container" actstash ping 2>/dev/null; then up=1; break; fi
    sleep 0.5
  done
  [ -n "$up" ] || { podman logs "$container"; fail "the daemon in the container never answered ping"; }
  podman exec "$container" actstash stats
  outside_ping
  log "verify: more than the pool through the daemon, every byte compared"
  podman exec "$container" actstash "${verify_args[@]}" || fail "actstash verify failed"
  check_metrics
  log "image HEALTHCHECK"
  podman healthcheck run "$container" || fail "healthcheck failed"
  log "healthcheck: healthy"
  log "SIGTERM (podman stop)"
  podman stop -t 20 "$container" >/dev/null
  local code
  code=$(podman inspect --format '{{.State.ExitCode}}' "$container")
  podman logs "$container" 2>&1 | tail -n 5
  [ "$code" = 0 ] || fail "daemon exited $code after SIGTERM"
  podman logs "$container" 2>&1 | grep -q stopped || fail "no 'stopped' in the daemon's log"
  podman rm "$container" >/dev/null
  log "podman run: low memlock limit, mlock auto"
  podman run -d --name "$container" --pull=never --network=none --ulimit memlock=65536:65536 \
    -v "$sockdir:/run/actstash" "$image" --socket "$socket_in" --pool-size 64MiB --mlock auto \
    >/dev/null
  for _ in $(seq 40); do podman logs "$container" 2>&1 | grep -q ready && break; sleep 0.25; done
  podman logs "$container" > "$work/mlock.log" 2>&1
  podman rm -f "$container" >/dev/null
  grep "continuing with unpinned memory" "$work/mlock.log" ||
    { cat "$work/mlock.log"; fail "no unpinned-memory warning under a 64 KiB memlock limit"; }
}

run_with_chroot() {
  podman create --name "$container-fs" --pull=never "$image" >/dev/null
  mnt=$(podman mount "$container-fs")
  log "image filesystem mounted at $mnt"
  mount -t proc proc "$mnt/proc" && mounted+=("$mnt/proc")
  mount --bind /dev "$mnt/dev" && mounted+=("$mnt/dev")
  mount --bind "$sockdir" "$mnt/run/actstash" && mounted+=("$mnt/run/actstash")
  local env=(env -i PATH=/usr/local/bin:/usr/bin:/bin ACTSTASH_ADDRESS="unix://$socket_in")
  local as_user=(chroot --userspec=10001:10001 "$mnt")
  log "chroot: libraries resolve"
  if chroot "$mnt" ldd /usr/local/bin/actstashd /usr/local/bin/actstash | grep 'not found'; then
    fail "missing shared libraries in the image"
  fi
  log "chroot: actstashd --help"
  "${as_user[@]}" "${env[@]}" /usr/local/bin/actstashd --help | sed -n '1,3p'  # reads it all: no SIGPIPE
  # Pinned, the two ways the deployments do it: a memlock limit above the pool
  # (docker --ulimit memlock), else CAP_IPC_LOCK as an ambient capability of
  # uid 10001 (the systemd unit). Raising the limit needs CAP_SYS_RESOURCE.
  local pin_how mlock_mode=on
  local start=("${as_user[@]}" "${env[@]}")
  if (ulimit -l unlimited) 2>/dev/null; then
    pin_how="memlock limit unlimited"
  elif [ -x "$mnt/usr/bin/setpriv" ] &&
       chroot "$mnt" /usr/bin/setpriv --reuid=10001 --regid=10001 --clear-groups \
         --inh-caps=+ipc_lock --ambient-caps=+ipc_lock /bin/true 2>/dev/null; then
    pin_how="ambient CAP_IPC_LOCK (the memlock limit cannot be raised here)"
    start=(chroot "$mnt" /usr/bin/setpriv --reuid=10001 --regid=10001 --clear-groups
           --inh-caps=+ipc_lock --ambient-caps=+ipc_lock "${env[@]}")
  else
    pin_how="NOT pinned: cannot raise the memlock limit nor pass CAP_IPC_LOCK here"
    mlock_mode=auto
  fi
  log "chroot: daemon as uid 10001, 256 MiB pool, spill tier, metrics, $pin_how"
  ( ulimit -l unlimited 2>/dev/null || true
    exec "${start[@]}" /usr/local/bin/actstashd --socket "$socket_in" "${pool_args[@]}" \
      "${metrics_args[@]}" --mlock "$mlock_mode" ) > "$work/daemon.log" 2>&1 &
  daemon_pid=$!
  local up=""
  for _ in $(seq 60); do
    if "${as_user[@]}" "${env[@]}" /usr/local/bin/actstash ping 2>/dev/null; then up=1; break; fi
    kill -0 "$daemon_pid" 2>/dev/null || break
    sleep 0.5
  done
  [ -n "$up" ] || { cat "$work/daemon.log"; fail "the daemon never answered ping"; }
  "${as_user[@]}" "${env[@]}" /usr/local/bin/actstash stats
  grep 'host pool:' "$work/daemon.log"
  if [ "$mlock_mode" = on ] && ! grep -Eq 'host pool:.*\(mlocked[;)]' "$work/daemon.log"; then
    fail "the pool is not pinned"
  fi
  outside_ping
  log "verify: more than the pool through the daemon, every byte compared"
  "${as_user[@]}" "${env[@]}" /usr/local/bin/actstash "${verify_args[@]}" ||
    fail "actstash verify failed"
  check_metrics
  log "image HEALTHCHECK command"
  local health
  health=$(/usr/bin/python3 -c 'import json,sys; i=json.load(open(sys.argv[1]))[0]; t=(i["Config"].get("Healthcheck") or i["Healthcheck"])["Test"]; print(" ".join(t[1:]))' "$work/image-inspect.json")
  # shellcheck disable=SC2086  # the command's words, as the image stores them
  "${as_user[@]}" "${env[@]}" $health || fail "healthcheck failed"
  log "healthcheck: healthy"
  log "SIGTERM"
  kill -TERM "$daemon_pid"
  local code=0
  wait "$daemon_pid" || code=$?
  daemon_pid=""
  tail -n 5 "$work/daemon.log"
  [ "$code" = 0 ] || fail "daemon exited $code after SIGTERM"
  grep -q stopped "$work/daemon.log" || fail "no 'stopped' in the daemon's log"
  [ ! -e "$sockdir/actstash.sock" ] || fail "socket left behind after the stop"
  log "chroot: low memlock limit, mlock auto"
  (ulimit -l 64; exec "${as_user[@]}" "${env[@]}" /usr/local/bin/actstashd \
     --socket "$socket_in" --pool-size 64MiB --mlock auto) > "$work/mlock.log" 2>&1 &
  daemon_pid=$!
  for _ in $(seq 80); do
    grep -q ready "$work/mlock.log" 2>/dev/null && break
    kill -0 "$daemon_pid" 2>/dev/null || break
    sleep 0.25
  done
  kill -TERM "$daemon_pid" 2>/dev/null || true
  wait "$daemon_pid" || true
  daemon_pid=""
  grep "continuing with unpinned memory" "$work/mlock.log" ||
    { cat "$work/mlock.log"; fail "no unpinned-memory warning under a 64 KiB memlock limit"; }
}

if [ "$mode" = podman-run ] ||
   { [ "$mode" = auto ] && podman run --rm --pull=never --network=none --entrypoint /bin/true "$image" 2>/dev/null; }; then
  log "containers run with podman run"
  run_with_podman
else
  [ "$mode" = auto ] && log "podman run does not work here; running the image's filesystem under chroot"
  run_with_chroot
fi
log "PASS ($image)"
log "(the build stage stays in podman's storage as an untagged image, for the layer cache; 'podman image prune' removes it)"
