# actstashd + the actstash CLI in a small Debian 12 image.
#
#   docker build -t actstash .                                # CPU only (default)
#   docker build --build-arg ACTSTASH_WITH_CUDA=ON -t actstash:cuda .
#
# Run it (see docs/OPERATIONS.md): the daemon pins its pool, which needs either
# a memlock limit above the pool size or CAP_IPC_LOCK, and shares its socket
# directory with the trainers:
#
#   install -d -o 10001 -g 10001 /run/actstash
#   docker run -d --name actstashd --ulimit memlock=-1:-1 --memory 17g \
#     -v /run/actstash:/run/actstash actstash \
#     --socket /run/actstash/actstash.sock --pool-size 16GiB
#
# Without a Docker daemon: deploy/test-image.sh builds and smoke-tests this
# file with podman (chroot isolation).

# Build base: Debian 12 (the project's gRPC 1.51, Protobuf 3.21, ... are
# Debian's). Another Debian 12 based image that already has the CUDA toolkit
# in /usr/local/cuda works too. The runtime base must be the same release: the
# runtime packages are looked up by the names they have in the build stage.
ARG BUILD_BASE=debian:bookworm
ARG RUNTIME_BASE=debian:bookworm-slim

FROM ${BUILD_BASE} AS build

# OFF: CPU-only. ON: CUDA support; nvcc comes from /usr/local/cuda when the
# build base has it, else from NVIDIA's Debian 12 apt repository (network).
ARG ACTSTASH_WITH_CUDA=OFF
ARG CUDA_VERSION=12.6
ARG CUDA_REPO=https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64
# Extra CMake arguments, e.g. "-DCMAKE_CUDA_ARCHITECTURES=90".
ARG CMAKE_ARGS=""
# ON: compile through the project's compiler cache (scripts/ccache), whose
# folder the builder binds in at /var/cache/actstash-ccache (podman build -v;
# deploy/test-image.sh does), so that a rebuild after a change compiles only
# what changed. OFF (default): no ccache in the image.
ARG ACTSTASH_CCACHE=OFF

ENV DEBIAN_FRONTEND=noninteractive
# The packages of purpose 'daemon' of the project's one list
# (scripts/debian-packages.txt): the toolchain and the daemon's and CLI's
# libraries (no tests, benchmarks, Python or torch).
COPY scripts/packages scripts/debian-packages.txt /tmp/actstash-packages/
RUN packages=$(sh /tmp/actstash-packages/packages daemon) && [ -n "$packages" ] \
 && if [ "$ACTSTASH_CCACHE" = ON ]; then \
      packages="$packages $(sh /tmp/actstash-packages/packages --groups cache)"; fi \
 && apt-get update \
 && apt-get install -y --no-install-recommends $packages \
 && rm -rf /var/lib/apt/lists/*

RUN set -eu; \
    if [ "$ACTSTASH_WITH_CUDA" = ON ] && [ ! -x /usr/local/cuda/bin/nvcc ]; then \
      apt-get update; \
      apt-get install -y --no-install-recommends ca-certificates curl; \
      curl -fsSL -o /tmp/cuda-keyring.deb "$CUDA_REPO/cuda-keyring_1.1-1_all.deb"; \
      dpkg -i /tmp/cuda-keyring.deb; \
      apt-get update; \
      cuda_pkg_version=$(echo "$CUDA_VERSION" | tr . -); \
      apt-get install -y --no-install-recommends \
        "cuda-nvcc-$cuda_pkg_version" "cuda-cudart-dev-$cuda_pkg_version"; \
      ln -sfn "/usr/local/cuda-$CUDA_VERSION" /usr/local/cuda; \
      rm -rf /var/lib/apt/lists/* /tmp/cuda-keyring.deb; \
    fi

WORKDIR /src
COPY . .
RUN cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DACTSTASH_WITH_CUDA="$ACTSTASH_WITH_CUDA" \
      -DACTSTASH_BUILD_PYTHON=OFF -DACTSTASH_BUILD_TORCH=OFF \
      -DACTSTASH_BUILD_TESTS=OFF -DACTSTASH_BUILD_BENCH=OFF \
      -DACTSTASH_CCACHE="$ACTSTASH_CCACHE" \
      $CMAKE_ARGS \
 && cmake --build /build --parallel "$(nproc)" --target actstashd actstash \
 && /build/server/actstashd --version

# Stage the binaries (debug info stripped, symbols kept for stack traces) and
# the runtime packages: purpose 'run' of the list, which must hold the owner
# of every shared library the binaries load (libc6, libgcc-s1 and libstdc++6
# are in every Debian image). A library whose package is missing from the
# list stops the build here, naming the package, rather than the container
# at its first start.
RUN set -eu; \
    mkdir -p /out/bin; \
    cp /build/server/actstashd /build/tools/actstash /out/bin/; \
    strip --strip-debug /out/bin/actstashd /out/bin/actstash; \
    if ldd /out/bin/actstashd /out/bin/actstash | grep 'not found'; then exit 1; fi; \
    sh /tmp/actstash-packages/packages run > /out/runtime-packages; \
    : > /tmp/owners; \
    for lib in $(ldd /out/bin/actstashd /out/bin/actstash | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u); do \
      owner=$(dpkg -S "$lib" 2>/dev/null || dpkg -S "$(readlink -f "$lib")" 2>/dev/null \
              || dpkg -S "$(echo "$lib" | sed 's|^/usr/lib/|/lib/|; t; s|^/lib/|/usr/lib/|')" 2>/dev/null) \
        || { echo "no Debian package provides $lib (needed at run time)" >&2; exit 1; }; \
      echo "$owner" | head -n 1 | cut -d: -f1 >> /tmp/owners; \
    done; \
    missing=""; \
    for p in $(sort -u /tmp/owners); do \
      case "$p" in libc6|libgcc-s1|libstdc++6) continue ;; esac; \
      grep -qx "$p" /out/runtime-packages || missing="$missing $p"; \
    done; \
    if [ -n "$missing" ]; then \
      echo "actstashd/actstash load libraries of$missing, which scripts/debian-packages.txt" \
           "does not list under 'run': add them there" >&2; \
      exit 1; \
    fi; \
    for p in $(cat /out/runtime-packages); do \
      grep -qx "$p" /tmp/owners || echo "note: runtime package $p is listed but no binary loads it"; \
    done; \
    echo "runtime packages:"; cat /out/runtime-packages

FROM ${RUNTIME_BASE}

ARG ACTSTASH_WITH_CUDA=OFF
LABEL org.opencontainers.image.title="actstash" \
      org.opencontainers.image.description="actstashd: node-local activation-offload daemon, and the actstash CLI" \
      org.opencontainers.image.documentation="docs/OPERATIONS.md" \
      io.actstash.cuda="${ACTSTASH_WITH_CUDA}"

COPY --from=build /out/runtime-packages /tmp/runtime-packages
RUN set -eu; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive xargs -a /tmp/runtime-packages \
      apt-get install -y --no-install-recommends; \
    rm -rf /var/lib/apt/lists/* /tmp/runtime-packages; \
    groupadd --system --gid 10001 actstash; \
    useradd --no-log-init --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin actstash; \
    install -d -o 10001 -g 10001 -m 0755 /run/actstash; \
    install -d -o 10001 -g 10001 -m 0750 /var/lib/actstash/spill; \
    install -d -m 0755 /etc/actstash

COPY --from=build /out/bin/actstashd /out/bin/actstash /usr/local/bin/

# A CUDA build links cudart statically; the driver (libcuda.so.1) comes from
# the host through the NVIDIA container toolkit, which reads these.
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    ACTSTASH_ADDRESS=unix:///run/actstash/actstash.sock

# Not root. Pinning the pool then needs a memlock limit (docker run --ulimit
# memlock=-1:-1) or CAP_IPC_LOCK, which a non-root process only gets as an
# ambient capability: on Kubernetes run it as uid 0 with only IPC_LOCK
# (deploy/k8s/daemonset.yaml). With neither, mlock = "auto" logs a warning
# and runs unpinned.
USER 10001:10001
# The gRPC socket and the attach socket beside it; share this directory with
# the trainers (a host directory, or a named volume).
VOLUME ["/run/actstash"]
# The spill tier's directory when the daemon runs with --spill-dir
# /var/lib/actstash/spill: mount a local disk there (-v /scratch:/var/lib/
# actstash/spill, owned by 10001); without a mount it lives in the container's
# writable layer.

HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["/usr/local/bin/actstash", "--timeout", "3", "ping"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/actstashd"]
# The default socket of a non-root daemon would be under $XDG_RUNTIME_DIR or
# /tmp; the image serves on the shared directory instead. Arguments given to
# `docker run` replace these: pass --socket (or --config with `socket`) too.
CMD ["--socket", "/run/actstash/actstash.sock"]
