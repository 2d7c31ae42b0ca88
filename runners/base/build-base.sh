#!/usr/bin/env bash
# build-base.sh - create the Debian base image for the runner images *offline*
# (no container registry needed), using debootstrap against the Debian archive.
#
# The result is tagged debian:bookworm-slim, i.e. the same tag the runner
# Dockerfiles use in FROM, so `docker build` works unchanged on machines that
# can pull the official image instead.
#
# Usage: runners/base/build-base.sh [--force] [--refresh] [--cache-dir DIR] [--tarball FILE]
#   --force        re-import the image even if it already exists
#   --refresh      ignore the cached rootfs tarball and debootstrap again
#                  (implies --force)
#   --no-upgrade   skip applying bookworm-updates/-security on top of the
#                  point release debootstrap installs (default: apply them)
#   --cache-dir D  keep the debootstrapped rootfs tarball (and the downloaded
#                  .debs) in D; default: $RUNNER_CACHE_DIR, unset = no cache
#   --tarball F    no Docker: write the rootfs tarball to F and import nothing
#                  (runners/rootfs.sh builds the runner file systems on it)
#
# Environment:
#   RUNNER_CACHE_DIR   default for --cache-dir
#   BASE_IMAGE         tag to create            (default debian:bookworm-slim)
#   DEBIAN_SUITE       suite                    (default bookworm)
#   DEBIAN_MIRROR      archive                  (default http://deb.debian.org/debian)
#   DEBIAN_SECURITY_MIRROR                      (default http://deb.debian.org/debian-security)
#   BASE_UPGRADE       0 = same as --no-upgrade
#
# Needs: root (debootstrap), debootstrap, tar; docker unless --tarball.
set -euo pipefail

BASE_IMAGE="${BASE_IMAGE:-debian:bookworm-slim}"
SUITE="${DEBIAN_SUITE:-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SECURITY_MIRROR="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
CACHE_DIR="${RUNNER_CACHE_DIR:-}"
FORCE=0
REFRESH=0
UPGRADE="${BASE_UPGRADE:-1}"
TARBALL_OUT=""

log() { printf '[build-base] %s\n' "$*" >&2; }
die() { printf '[build-base] ERROR: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --force) FORCE=1 ;;
    --refresh) REFRESH=1; FORCE=1 ;;
    --no-upgrade) UPGRADE=0 ;;
    --cache-dir) [ $# -ge 2 ] || die "--cache-dir needs an argument"; CACHE_DIR="$2"; shift ;;
    --cache-dir=*) CACHE_DIR="${1#*=}" ;;
    --tarball) [ $# -ge 2 ] || die "--tarball needs an argument"; TARBALL_OUT="$2"; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
  shift
done

START=$(date +%s)
if [ -z "$TARBALL_OUT" ]; then
  command -v docker >/dev/null || die "docker not found (without Docker, use --tarball)"
  docker info >/dev/null 2>&1 || die "cannot talk to the docker daemon (is dockerd running?)"
fi

if [ -z "$TARBALL_OUT" ] && [ "$FORCE" = 0 ] && docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  log "$BASE_IMAGE already present ($(docker image inspect -f '{{.Id}}' "$BASE_IMAGE" | cut -c1-19)); skipping (use --force to rebuild)"
  exit 0
fi

ARCH="$(dpkg --print-architecture 2>/dev/null || echo amd64)"
TARBALL=""
if [ -n "$CACHE_DIR" ]; then
  mkdir -p "$CACHE_DIR"
  CACHE_DIR="$(cd "$CACHE_DIR" && pwd)"
  TARBALL="$CACHE_DIR/debian-$SUITE-minbase-$ARCH$([ "$UPGRADE" = 1 ] || echo -noupgrade).rootfs.tar"
fi

WORK=""
cleanup() { if [ -n "$WORK" ] && [ -d "$WORK" ]; then rm -rf --one-file-system "$WORK"; fi; }
trap cleanup EXIT

if [ -n "$TARBALL" ] && [ -s "$TARBALL" ] && [ "$REFRESH" = 0 ]; then
  log "using cached rootfs $TARBALL"
else
  [ "$(id -u)" = 0 ] || die "debootstrap needs root"
  command -v debootstrap >/dev/null || die "debootstrap not found (apt-get install debootstrap)"
  WORK="$(mktemp -d "${TMPDIR:-/var/tmp}/build-base.XXXXXX")"
  ROOTFS="$WORK/rootfs"
  DEB_CACHE_ARGS=()
  if [ -n "$CACHE_DIR" ]; then
    mkdir -p "$CACHE_DIR/debs"
    DEB_CACHE_ARGS=(--cache-dir="$CACHE_DIR/debs")
  fi
  log "debootstrap --variant=minbase $SUITE ($ARCH) from $MIRROR ..."
  t0=$(date +%s)
  if ! debootstrap --variant=minbase --arch="$ARCH" "${DEB_CACHE_ARGS[@]}" \
        "$SUITE" "$ROOTFS" "$MIRROR" >"$WORK/debootstrap.log" 2>&1; then
    tail -n 30 "$WORK/debootstrap.log" >&2
    [ -f "$ROOTFS/debootstrap/debootstrap.log" ] && tail -n 30 "$ROOTFS/debootstrap/debootstrap.log" >&2
    die "debootstrap failed"
  fi
  log "debootstrap done in $(( $(date +%s) - t0 ))s"

  log "configuring and trimming the rootfs"
  # apt sources like the official image (deb822), incl. updates and security
  rm -f "$ROOTFS/etc/apt/sources.list"
  cat >"$ROOTFS/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: $SUITE $SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $SECURITY_MIRROR
Suites: $SUITE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  if [ "$UPGRADE" = 1 ]; then
    # debootstrap installs the suite's point release only; pull in
    # $SUITE-updates and $SUITE-security like the official images have.
    log "applying $SUITE-updates / $SUITE-security upgrades"
    t0=$(date +%s)
    if ! chroot "$ROOTFS" /bin/sh -c 'export DEBIAN_FRONTEND=noninteractive LC_ALL=C;
          apt-get -o Acquire::Languages=none update &&
          apt-get -y --no-install-recommends -o Dpkg::Options::=--force-confold dist-upgrade &&
          apt-get clean' >"$WORK/upgrade.log" 2>&1; then
      tail -n 30 "$WORK/upgrade.log" >&2
      die "apt-get upgrade inside the new rootfs failed"
    fi
    log "upgrade done ($(grep -oE '^[0-9]+ upgraded, [0-9]+ newly installed' "$WORK/upgrade.log" | head -1 || true)) in $(( $(date +%s) - t0 ))s"
  fi
  # The same container tweaks as the official debian:*-slim images
  # (debuerreotype): never install docs/man/locales, clean apt caches.
  cat >"$ROOTFS/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
# keep images small: no docs, man pages or translations (copyright files kept)
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
  cat >"$ROOTFS/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  cat >"$ROOTFS/etc/apt/apt.conf.d/docker-no-languages" <<'EOF'
Acquire::Languages "none";
EOF
  cat >"$ROOTFS/etc/apt/apt.conf.d/docker-gzip-indexes" <<'EOF'
Acquire::GzipIndexes "true";
Acquire::CompressionTypes::Order:: "gz";
EOF
  cat >"$ROOTFS/etc/apt/apt.conf.d/docker-autoremove-suggests" <<'EOF'
Apt::AutoRemove::SuggestsImportant "false";
EOF
  # policy-rc.d: never start services inside image builds
  printf '#!/bin/sh\nexit 101\n' >"$ROOTFS/usr/sbin/policy-rc.d"
  chmod 0755 "$ROOTFS/usr/sbin/policy-rc.d"

  # trim: docs, man pages, locales, apt lists/caches, logs, debootstrap leftovers
  find "$ROOTFS/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete 2>/dev/null || true
  find "$ROOTFS/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true
  rm -rf "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* "$ROOTFS"/usr/share/groff/* \
         "$ROOTFS"/usr/share/lintian/* "$ROOTFS"/usr/share/linda/*
  find "$ROOTFS/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} + 2>/dev/null || true
  rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/* "$ROOTFS"/var/cache/debconf/*-old \
         "$ROOTFS"/var/lib/dpkg/*-old "$ROOTFS"/debootstrap "$ROOTFS"/tmp/* "$ROOTFS"/var/tmp/*
  find "$ROOTFS/var/log" -type f -delete
  : >"$ROOTFS/etc/machine-id"          # generated per container, like the official image
  : >"$ROOTFS/etc/resolv.conf"; : >"$ROOTFS/etc/hostname"   # docker bind-mounts these
  rm -f "$ROOTFS/etc/hosts" && printf '127.0.0.1\tlocalhost\n' >"$ROOTFS/etc/hosts"

  OUT="${TARBALL:-$WORK/rootfs.tar}"
  tar --numeric-owner --xattrs -C "$ROOTFS" -cf "$OUT.partial" .
  mv -f "$OUT.partial" "$OUT"
  TARBALL="$OUT"
  log "rootfs tarball: $TARBALL ($(du -h "$TARBALL" | cut -f1))"
fi

if [ -n "$TARBALL_OUT" ]; then
  cp -f "$TARBALL" "$TARBALL_OUT.partial" && mv -f "$TARBALL_OUT.partial" "$TARBALL_OUT"
  log "base rootfs tarball ready in $(( $(date +%s) - START ))s"
  exit 0
fi

log "importing as $BASE_IMAGE"
docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["bash"]' \
  --message "debootstrap --variant=minbase $SUITE $MIRROR (runners/base/build-base.sh)" \
  - "$BASE_IMAGE" <"$TARBALL" >/dev/null

docker run --rm --network none "$BASE_IMAGE" sh -c '. /etc/os-release && echo "$PRETTY_NAME"' >/dev/null \
  || die "imported image does not start"
log "$BASE_IMAGE ready ($(docker image inspect -f '{{.Size}}' "$BASE_IMAGE" | awk '{printf "%.0f MB", $1/1e6}')) in $(( $(date +%s) - START ))s"
