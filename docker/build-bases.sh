#!/usr/bin/env bash
# Stand-in base images for a Docker engine that cannot pull: builds, from
# Debian's packages, each image the Dockerfile and the compose files name
# that the engine lacks, under the very tag they use. Where an image with
# that tag exists (pulled from a registry, or built before), it does nothing
# for it. Users with a registry never need this script.
#
#   debian:bookworm-slim      debootstrap (minbase) of bookworm, imported
#   rust:1.89-bookworm        that + gcc and this machine's Rust toolchain
#                             (the newest here: the workspace needs >= 1.89)
#                             and certificate authorities (cargo fetches
#                             crates through whatever this machine trusts)
#   prom/prometheus:v2.42.0   that + Debian's prometheus (2.42.0), laid out
#                             as the upstream image (/bin/prometheus, /prometheus)
#   quay.io/coreos/etcd:v3.4.23  that + Debian's etcd-server (3.4.23) as
#                             /usr/local/bin/etcd, as the upstream image
#
# Each stand-in carries the label kvtier.stand-in saying what it holds;
# `docker rmi` them to use the real images once a registry is reachable
# (an engine that can pull needs none of this: `docker pull` the tags).
# Needs root (debootstrap), debootstrap and a Debian mirror.
set -euo pipefail

MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
STAND_IN="kvtier.stand-in"

have() { docker image inspect "$1" >/dev/null 2>&1; }

# The classic builder (no buildx here), its output kept for a failure only.
quiet_build() {
  local log
  log=$(mktemp)
  if ! DOCKER_BUILDKIT=0 docker build "$@" >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    return 1
  fi
  rm -f "$log"
}

# One image FROM debian:bookworm-slim with Debian packages added, then the
# rest of a Dockerfile (lines on stdin).
from_debian() {
  local tag=$1 what=$2 packages=$3
  echo "build-bases: $tag <- Debian's $packages"
  {
    echo "FROM debian:bookworm-slim"
    echo "RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $packages >/dev/null && rm -rf /var/lib/apt/lists/*"
    cat
    echo "LABEL $STAND_IN=\"$what\""
  } | quiet_build -t "$tag" -
}

if have debian:bookworm-slim; then
  echo "build-bases: debian:bookworm-slim present"
else
  command -v debootstrap >/dev/null || {
    echo "build-bases: debootstrap is missing (apt-get install debootstrap)" >&2
    exit 1
  }
  root=$(mktemp -d)
  trap 'rm -rf "$root"' EXIT
  echo "build-bases: debian:bookworm-slim <- debootstrap --variant=minbase bookworm $MIRROR"
  debootstrap --variant=minbase bookworm "$root" "$MIRROR" >/dev/null
  # As the upstream image: no caches, no docs, apt's sources on the mirror.
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* "$root"/usr/share/man/*
  tar -C "$root" -c . | docker import \
    --change 'CMD ["bash"]' \
    --change "LABEL $STAND_IN=\"debootstrap --variant=minbase bookworm\"" \
    - debian:bookworm-slim >/dev/null
  rm -rf "$root"
  trap - EXIT
fi

if have rust:1.89-bookworm; then
  echo "build-bases: rust:1.89-bookworm present"
else
  sysroot=$(rustc --print sysroot)
  version=$(rustc --version)
  # The workspace needs 1.89; a toolchain of its own (rustup's), not a
  # distribution's spread over /usr.
  read -r major minor < <(rustc --version | awk '{ split($2, v, "."); print v[1], v[2] }')
  if [ "$major" -lt 1 ] || { [ "$major" -eq 1 ] && [ "$minor" -lt 89 ]; }; then
    echo "build-bases: $version is older than the 1.89 the workspace needs" >&2
    exit 1
  fi
  if [ "$sysroot" = /usr ] || [ ! -x "$sysroot/bin/cargo" ]; then
    echo "build-bases: the toolchain at $sysroot is not a self-contained one (install it with rustup)" >&2
    exit 1
  fi
  # The upstream image's layout: toolchain under /usr/local, cargo's home
  # /usr/local/cargo on PATH. The toolchain is copied without its docs.
  context=$(mktemp -d)
  trap 'rm -rf "$context"' EXIT
  mkdir -p "$context/rust"
  tar -C "$sysroot" --exclude=./share/doc -c . | tar -C "$context/rust" -x
  # This machine's own certificate authorities (an egress proxy's, say):
  # cargo inside the build must trust what the machine trusts.
  mkdir -p "$context/ca"
  cp /usr/local/share/ca-certificates/*.crt "$context/ca/" 2>/dev/null || true
  {
    echo "FROM debian:bookworm-slim"
    echo "RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ca-certificates gcc libc6-dev make pkg-config git >/dev/null && rm -rf /var/lib/apt/lists/*"
    echo "COPY rust /usr/local/rust"
    echo "COPY ca /usr/local/share/ca-certificates"
    echo "RUN update-ca-certificates >/dev/null"
    echo "ENV CARGO_HOME=/usr/local/cargo PATH=/usr/local/rust/bin:/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    echo "LABEL $STAND_IN=\"bookworm + gcc + $version\""
  } >"$context/Dockerfile"
  echo "build-bases: rust:1.89-bookworm <- debian:bookworm-slim + gcc + $version"
  quiet_build -t rust:1.89-bookworm "$context"
  rm -rf "$context"
  trap - EXIT
fi

if have prom/prometheus:v2.42.0; then
  echo "build-bases: prom/prometheus:v2.42.0 present"
else
  from_debian prom/prometheus:v2.42.0 "bookworm + Debian's prometheus 2.42.0" prometheus <<'EOF'
# /bin is /usr/bin on bookworm: the binary is at /bin/prometheus already.
RUN mkdir -p /prometheus /etc/prometheus && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
EOF
fi

if have quay.io/coreos/etcd:v3.4.23; then
  echo "build-bases: quay.io/coreos/etcd:v3.4.23 present"
else
  from_debian quay.io/coreos/etcd:v3.4.23 "bookworm + Debian's etcd-server and etcd-client 3.4.23" "etcd-server etcd-client" <<'EOF'
RUN ln -s /usr/bin/etcd /usr/local/bin/etcd && ln -s /usr/bin/etcdctl /usr/local/bin/etcdctl && mkdir -p /etcd-data
EXPOSE 2379 2380
CMD ["/usr/local/bin/etcd"]
EOF
fi
