#!/usr/bin/env bash
# Lints the deployment files: the Kubernetes manifests with yamllint
# (installed with apt-get if missing) and against the Kubernetes API's
# schemas (kubernetes-validate from PyPI), the systemd unit with
# `systemd-analyze verify` (skipped with a message where systemd-analyze is
# missing), and the shell scripts with shellcheck when it is installed.
# Exit status: 0 clean, 1 a finding.
set -euo pipefail
cd "$(dirname "$0")/.."

status=0
YAMLLINT_CONFIG='{extends: default, rules: {line-length: {max: 120}, document-start: disable}}'

if ! command -v yamllint >/dev/null; then
  echo "deploy/lint.sh: installing yamllint"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends yamllint >/dev/null
fi
echo "deploy/lint.sh: yamllint deploy/k8s"
if yamllint --strict -d "$YAMLLINT_CONFIG" deploy/k8s/; then
  echo "  ok"
else
  status=1
fi

# The manifests against the Kubernetes API's own schemas, strictly (an
# unknown or misplaced field fails), for the oldest and the newest Kubernetes
# the manifests support: kubernetes-validate from PyPI (its schemas are
# bundled; no cluster), in a venv cached on the machine.
KUBE_VALIDATE_VERSION=1.37.0
KUBE_VERSIONS=(1.29.0 1.37.0)
tools_cache=/var/cache/actstash-tools
[ "$(id -u)" -eq 0 ] || tools_cache=${XDG_CACHE_HOME:-$HOME/.cache}/actstash-tools
venv=${ACTSTASH_TOOLS_CACHE:-$tools_cache}/kubernetes-validate-$KUBE_VALIDATE_VERSION
if [ ! -x "$venv/bin/kubernetes-validate" ]; then
  echo "deploy/lint.sh: installing kubernetes-validate $KUBE_VALIDATE_VERSION into $venv"
  rm -rf "$venv"
  if ! { /usr/bin/python3 -m venv "$venv" &&
         "$venv/bin/pip" install -q --disable-pip-version-check \
           "kubernetes-validate==$KUBE_VALIDATE_VERSION"; }; then
    echo "  could not install it (PyPI unreachable?): the schema check FAILED"
    rm -rf "$venv"
    status=1
  fi
fi
if [ -x "$venv/bin/kubernetes-validate" ]; then
  for version in "${KUBE_VERSIONS[@]}"; do
    echo "deploy/lint.sh: kubernetes-validate --strict deploy/k8s (Kubernetes $version)"
    if "$venv/bin/kubernetes-validate" --strict --quiet -k "$version" deploy/k8s/*.yaml; then
      echo "  ok"
    else
      status=1
    fi
  done
fi

# The TOML embedded in the ConfigMap must parse and name only keys the daemon
# knows (an unknown key stops it at start): start the built daemon on it, if
# there is one, with a small pool and a scratch socket instead of the file's.
daemon=build/server/actstashd
if [ -x "$daemon" ] && /usr/bin/python3 -c 'import yaml' 2>/dev/null; then
  echo "deploy/lint.sh: the ConfigMap's actstashd.toml, read by $daemon"
  scratch=$(mktemp -d)
  /usr/bin/python3 - deploy/k8s/configmap.yaml "$scratch/actstashd.toml" <<'PY'
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
open(sys.argv[2], "w").write(doc["data"]["actstashd.toml"])
PY
  "$daemon" --config "$scratch/actstashd.toml" --socket "$scratch/s.sock" --pool-size 64MiB \
    --max-session-quota 64MiB --default-session-quota 64MiB --mlock off --log-level warn \
    > "$scratch/log" 2>&1 &
  pid=$!
  for _ in $(seq 80); do
    [ -S "$scratch/s.sock" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.25
  done
  if [ -S "$scratch/s.sock" ]; then
    kill -TERM "$pid"
    wait "$pid" || true
    echo "  ok"
  else
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" || true
    sed 's/^/  /' "$scratch/log"
    status=1
  fi
  rm -rf "$scratch"
else
  echo "deploy/lint.sh: skipping the ConfigMap's TOML check (needs $daemon and python3-yaml)"
fi

unit=deploy/systemd/actstashd.service
if command -v systemd-analyze >/dev/null; then
  echo "deploy/lint.sh: systemd-analyze verify $unit"
  # verify insists that ExecStart's program exists: check a copy that runs
  # the built daemon (or /bin/true) where the unit names /usr/local/bin.
  tmp=$(mktemp -d)
  program=/usr/local/bin/actstashd
  if [ ! -x "$program" ]; then
    program=$PWD/$daemon
    [ -x "$program" ] || program=/bin/true
    echo "  (ExecStart checked with $program: /usr/local/bin/actstashd is not installed here)"
  fi
  sed "s|^ExecStart=/usr/local/bin/actstashd|ExecStart=$program|" "$unit" > "$tmp/actstashd.service"
  if output=$(systemd-analyze verify "$tmp/actstashd.service" 2>&1) && [ -z "$output" ]; then
    echo "  ok"
  else
    printf '%s\n' "$output" | while IFS= read -r line; do echo "  $line"; done
    status=1
  fi
  if exposure=$(systemd-analyze security --offline=yes "$tmp/actstashd.service" 2>/dev/null | tail -n 1); then
    echo "  ${exposure#→ }"
  fi
  rm -rf "$tmp"
else
  echo "deploy/lint.sh: systemd-analyze not found; skipping the unit check"
fi

if command -v shellcheck >/dev/null; then
  echo "deploy/lint.sh: shellcheck -x deploy/*.sh"
  if shellcheck -x deploy/*.sh; then echo "  ok"; else status=1; fi
else
  echo "deploy/lint.sh: shellcheck not found; skipping the scripts"
fi

[ "$status" -eq 0 ] && echo "deploy/lint.sh: clean" || echo "deploy/lint.sh: FAILED"
exit "$status"
