#!/usr/bin/env bash
# build.sh - build the sandbox-broker runner images and the runner file
# systems of the process backend (called by `make runners`).
#
# Usage: runners/build.sh [options] [python|typescript|bash|node|agent ...]   (default: all)
#   --rebuild-base   re-import debian:bookworm-slim even if present (build-base.sh --force)
#   --no-cache       pass --no-cache to docker build
#   --no-rootfs      images only
#   -h, --help       this text
#
# Steps: 1) runners/base/build-base.sh creates debian:bookworm-slim offline with
# debootstrap unless the image already exists; 2) `docker build` of each
# runners/<lang>/Dockerfile, tagged sandbox-broker/runner-<lang>:latest;
# 3) runners/rootfs.sh exports each image of $RUNNER_ROOTFS (python typescript
# bash) into $SANDBOX_RUNNERS_DIR for the process backend. Without a Docker
# daemon only step 3 runs, with debootstrap (rootfs.sh --from debootstrap).
#
# Environment:
#   RUNNER_CACHE_DIR   cache dir for the debootstrap rootfs tarball (see build-base.sh)
#   RUNNER_TAG         image tag (default latest)
#   RUNNER_BUILDKIT    1 = build with BuildKit (needs the docker buildx plugin; the
#                      Debian docker.io 20.10 set-up here has none). Default: classic builder.
#   NPM_CA_BUNDLE      CA bundle handed to the discarded npm stage of the typescript,
#                      node and agent images (default /etc/ssl/certs/ca-certificates.crt if present).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ALL_LANGS=(python typescript bash node agent)
TAG="${RUNNER_TAG:-latest}"
NPM_CA_BUNDLE="${NPM_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
BASE_ARGS=()
BUILD_ARGS=()
LANGS=()
ROOTFS=1

log() { printf '[runners] %s\n' "$*" >&2; }
die() { printf '[runners] ERROR: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --rebuild-base) BASE_ARGS+=(--force) ;;
    --no-cache) BUILD_ARGS+=(--no-cache) ;;
    --no-rootfs) ROOTFS=0 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option: $1 (see --help)" ;;
    *)
      case " ${ALL_LANGS[*]} " in
        *" $1 "*) LANGS+=("$1") ;;
        *) die "unknown runner '$1' (known: ${ALL_LANGS[*]})" ;;
      esac ;;
  esac
  shift
done
[ ${#LANGS[@]} -gt 0 ] || LANGS=("${ALL_LANGS[@]}")

# The runner file systems of the process backend: the requested languages
# among $RUNNER_ROOTFS.
ROOTFS_LANGS=()
for lang in ${RUNNER_ROOTFS:-python typescript bash}; do
  case " ${LANGS[*]} " in *" $lang "*) ROOTFS_LANGS+=("$lang") ;; esac
done

if ! command -v docker >/dev/null || ! docker info >/dev/null 2>&1; then
  [ "$ROOTFS" = 1 ] || die "no Docker daemon, and --no-rootfs leaves nothing to build"
  log "no Docker daemon: building only the process backend's runner file systems, with debootstrap"
  [ ${#ROOTFS_LANGS[@]} -gt 0 ] || exit 0
  exec "$HERE/rootfs.sh" --from debootstrap "${ROOTFS_LANGS[@]}"
fi

# Builder choice. Docker 20.10's daemon embeds BuildKit, but a docker CLI >= 23
# only drives it through the buildx plugin, which is not installed here, and
# DOCKER_BUILDKIT=1 then fails outright. The classic builder needs nothing from
# a registry, so it is the default.
if [ "${RUNNER_BUILDKIT:-0}" = 1 ]; then
  docker buildx version >/dev/null 2>&1 || die "RUNNER_BUILDKIT=1 but the docker buildx plugin is missing"
  export DOCKER_BUILDKIT=1
  log "builder: BuildKit"
else
  export DOCKER_BUILDKIT=0
  log "builder: classic (DOCKER_BUILDKIT=0)"
fi

TMP="$(mktemp -d "${TMPDIR:-/tmp}/runners-build.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT

T_ALL=$(date +%s)
declare -A SECS=()

t0=$(date +%s)
"$HERE/base/build-base.sh" "${BASE_ARGS[@]}"
SECS[base]=$(( $(date +%s) - t0 ))

for lang in "${LANGS[@]}"; do
  image="sandbox-broker/runner-$lang:$TAG"
  ctx="$HERE/$lang"
  [ -f "$ctx/Dockerfile" ] || die "missing $ctx/Dockerfile"
  if [ "$lang" = typescript ] || [ "$lang" = node ] || [ "$lang" = agent ]; then
    # npm runs in a discarded build stage; give it the host's CA bundle (a TLS
    # intercepting proxy's CA may only be there). It never reaches the final image.
    ctx="$TMP/ctx-$lang"
    cp -a "$HERE/$lang" "$ctx"
    cp "$HERE/fetch-verified.mjs" "$ctx/" # one copy, shared by the three images
    rm -f "$ctx/host-ca.crt"
    if [ -s "$NPM_CA_BUNDLE" ]; then
      cp "$NPM_CA_BUNDLE" "$ctx/host-ca.crt"
    else
      log "no CA bundle at $NPM_CA_BUNDLE; npm will use Debian's ca-certificates"
    fi
  fi
  log "building $image from runners/$lang ..."
  t0=$(date +%s)
  if ! docker build "${BUILD_ARGS[@]}" -t "$image" -f "$ctx/Dockerfile" "$ctx" >"$TMP/build-$lang.log" 2>&1; then
    tail -n 40 "$TMP/build-$lang.log" >&2
    die "docker build of $image failed (full log above is the tail of $TMP/build-$lang.log)"
  fi
  SECS[$lang]=$(( $(date +%s) - t0 ))
  log "built $image in ${SECS[$lang]}s"
done

if [ "$ROOTFS" = 1 ] && [ ${#ROOTFS_LANGS[@]} -gt 0 ] && [ "$(id -u)" != 0 ]; then
  log "skipping the runner file systems: they must be owned by root (sudo runners/rootfs.sh)"
elif [ "$ROOTFS" = 1 ] && [ ${#ROOTFS_LANGS[@]} -gt 0 ]; then
  log "runner file systems (${ROOTFS_LANGS[*]}) for the process backend ..."
  t0=$(date +%s)
  "$HERE/rootfs.sh" --from docker "${ROOTFS_LANGS[@]}"
  SECS[rootfs]=$(( $(date +%s) - t0 ))
fi

printf '\n%-40s %8s %10s\n' IMAGE SECONDS SIZE
printf '%-40s %8s %10s\n' "debian:bookworm-slim (base)" "${SECS[base]}" \
  "$(docker image inspect -f '{{.Size}}' debian:bookworm-slim | awk '{printf "%.0fMB", $1/1e6}')"
for lang in "${LANGS[@]}"; do
  printf '%-40s %8s %10s\n' "sandbox-broker/runner-$lang:$TAG" "${SECS[$lang]}" \
    "$(docker image inspect -f '{{.Size}}' "sandbox-broker/runner-$lang:$TAG" | awk '{printf "%.0fMB", $1/1e6}')"
done
[ -z "${SECS[rootfs]:-}" ] || printf '%-40s %8s\n' "runner file systems (${ROOTFS_LANGS[*]})" "${SECS[rootfs]}"
printf '%-40s %8s\n' TOTAL "$(( $(date +%s) - T_ALL ))"
