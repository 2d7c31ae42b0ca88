#!/usr/bin/env bash
# rootfs.sh - build the runner file systems the process (bubblewrap) backend
# runs code on: each runner image's file system as a plain directory, so
# that Python with its data stack, TypeScript and Bash are the same with or
# without a Docker daemon (called by build.sh, i.e. `make runners`).
#
# Usage: runners/rootfs.sh [--from docker|debootstrap] [--force] [lang ...]
#   (default languages: $RUNNER_ROOTFS, i.e. python typescript bash)
#   --from docker       export each built image (docker create + docker export);
#                       the default when a Docker daemon answers. An image whose
#                       ID the current tree's manifest already names is skipped.
#   --from debootstrap  no Docker: debootstrap the base (base/build-base.sh
#                       --tarball) and run each runners/<lang>/Dockerfile's
#                       steps in a chroot of it (RUN, COPY, ENV, ARG, WORKDIR,
#                       LABEL; multi-stage with COPY --from). Needs root and
#                       HTTP to the Debian mirror (and HTTPS to the npm registry
#                       for typescript and node). Runs the repository's own
#                       Dockerfiles only: a chroot is no sandbox.
#   --force             rebuild even when the tree is up to date
#
# Layout (services/runnerfs): $SANDBOX_RUNNERS_DIR/<lang> is a symlink to the
# generation <lang>.<id>/{manifest.json,rootfs/}. A new generation is built
# beside the old one and the symlink swapped; the previous generation is kept
# (a running broker keeps the tree it verified at start: restart it to use
# the new one) and older ones are removed.
#
# Environment:
#   SANDBOX_RUNNERS_DIR  output (default ${SANDBOX_ROOT:-./data}/runners, which
#                        is where the broker looks by default)
#   RUNNER_ROOTFS        default languages (python typescript bash)
#   RUNNER_TAG           image tag (default latest)
#   SANDBOX_BROKER       broker binary for `runners seal`/`verify` (default: go
#                        build of ./cmd/sandbox-broker, else bin/sandbox-broker,
#                        else sandbox-broker on PATH)
#   RUNNER_CACHE_DIR, DEBIAN_MIRROR, ...  see base/build-base.sh (debootstrap)
#   NPM_CA_BUNDLE        CA bundle for npm in the debootstrap route (see build.sh)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
TAG="${RUNNER_TAG:-latest}"
DIR="${SANDBOX_RUNNERS_DIR:-${SANDBOX_ROOT:-./data}/runners}"
NPM_CA_BUNDLE="${NPM_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
FROM=""
FORCE=0
LANGS=()

log() { printf '[rootfs] %s\n' "$*" >&2; }
die() { printf '[rootfs] ERROR: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --from) [ $# -ge 2 ] || die "--from needs docker or debootstrap"; FROM="$2"; shift ;;
    --from=*) FROM="${1#*=}" ;;
    --force) FORCE=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option: $1 (see --help)" ;;
    *)
      case "$1" in
        python|typescript|bash|node) LANGS+=("$1") ;;
        *) die "unknown runner '$1' (known: python typescript bash node)" ;;
      esac ;;
  esac
  shift
done
# shellcheck disable=SC2206
[ ${#LANGS[@]} -gt 0 ] || LANGS=(${RUNNER_ROOTFS:-python typescript bash})
[ "$(id -u)" = 0 ] || die "needs root: the trees must be owned by root (and debootstrap needs it)"
if [ -z "$FROM" ]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then FROM=docker; else FROM=debootstrap; fi
fi
case "$FROM" in docker|debootstrap) ;; *) die "--from must be docker or debootstrap" ;; esac

TMP="$(mktemp -d "${TMPDIR:-/tmp}/runners-rootfs.XXXXXX")"
MOUNTS=()
cleanup() {
  local m
  for m in "${MOUNTS[@]}"; do umount -l "$m" 2>/dev/null || true; done
  rm -rf --one-file-system "$TMP"
  if [ -n "${BUILD:-}" ] && [ -d "$BUILD" ]; then rm -rf --one-file-system "$BUILD"; fi
}
trap cleanup EXIT

# The broker binary seals and verifies trees (services/runnerfs).
BROKER="${SANDBOX_BROKER:-}"
if [ -z "$BROKER" ]; then
  if command -v go >/dev/null && [ -f "$REPO/go.mod" ]; then
    (cd "$REPO" && CGO_ENABLED=0 go build -o "$TMP/sandbox-broker" ./cmd/sandbox-broker) || die "go build of the broker failed"
    BROKER="$TMP/sandbox-broker"
  elif [ -x "$REPO/bin/sandbox-broker" ]; then
    BROKER="$REPO/bin/sandbox-broker"
  else
    BROKER="$(command -v sandbox-broker)" || die "no broker binary: set SANDBOX_BROKER or install Go"
  fi
fi

mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
# Sandboxes (other uids) traverse it; only root writes.
chown root:root "$DIR"; chmod 0755 "$DIR"

# install_generation LANG ID-SUFFIX: move the sealed $BUILD into place,
# swap the symlink and keep only the previous generation beside it.
install_generation() {
  local lang="$1" gen="$1.$2" prev="" g
  prev="$(readlink "$DIR/$lang" 2>/dev/null || true)"
  if [ "$prev" = "$gen" ]; then
    gen="$gen-$(date -u +%Y%m%d%H%M%S)" # --force on the same image
  elif [ -e "$DIR/$gen" ]; then
    rm -rf --one-file-system "${DIR:?}/$gen"
  fi
  mv "$BUILD" "$DIR/$gen"; BUILD=""
  ln -sfn "$gen" "$DIR/.$lang.link"
  mv -T "$DIR/.$lang.link" "$DIR/$lang"
  for g in "$DIR/$lang".*; do
    [ -d "$g" ] || continue
    case "$(basename "$g")" in "$gen"|"$prev") ;; *) rm -rf --one-file-system "$g" ;; esac
  done
}

# current_image_id LANG: the image ID the current generation was exported from.
current_image_id() {
  local m="$DIR/$1/manifest.json"
  [ -L "$DIR/$1" ] && [ -f "$m" ] || return 0
  sed -n 's/^  "image_id": "\(sha256:[0-9a-f]*\)",$/\1/p' "$m"
}

from_docker() {
  local lang="$1" image="sandbox-broker/runner-$1:$TAG" id label cid
  id="$(docker image inspect -f '{{.Id}}' "$image" 2>/dev/null)" || die "image $image is missing (runners/build.sh $lang)"
  label="$(docker image inspect -f '{{index .Config.Labels "sandbox.language"}}' "$image")"
  [ "$label" = "$lang" ] || die "$image is labelled sandbox.language=$label, not $lang"
  if [ "$FORCE" = 0 ] && [ "$(current_image_id "$lang")" = "$id" ]; then
    log "$lang: up to date (${id:0:19})"
    return 0
  fi
  BUILD="$(mktemp -d "$DIR/.build-$lang.XXXXXX")"
  mkdir "$BUILD/rootfs"
  cid="$(docker create --network none "$image" /opt/sandbox/broker)"
  # (device nodes come along and go again in seal; the build dir is 0700)
  if ! docker export "$cid" | tar -x -C "$BUILD/rootfs" --numeric-owner; then
    docker rm -f "$cid" >/dev/null; die "export of $image failed"
  fi
  docker rm -f "$cid" >/dev/null
  local env=()
  while IFS= read -r e; do [ -n "$e" ] && env+=(--env "$e"); done \
    < <(docker image inspect -f '{{range .Config.Env}}{{println .}}{{end}}' "$image")
  "$BROKER" runners seal --dir "$BUILD" --language "$lang" --image "$image" --image-id "$id" --built-by docker-export "${env[@]}" >&2
  install_generation "$lang" "${id:7:12}"
}

# --- no Docker: the Dockerfile's steps in a chroot -----------------------------

BASE_TAR=""
base_tarball() {
  [ -n "$BASE_TAR" ] && return 0
  BASE_TAR="$TMP/base.tar"
  "$HERE/base/build-base.sh" --tarball "$BASE_TAR"
}

# chroot_run STAGE WORKDIR CMD: CMD with /bin/sh -c in the stage's tree, with
# the stage's ARG and ENV values, as Docker's RUN does.
chroot_run() {
  local root="$1" wd="$2" cmd="$3"
  env -i "${STAGE_ENV[@]}" chroot "$root" /bin/sh -c "mkdir -p \"\$0\" && cd \"\$0\" && $cmd" "$wd"
}

# dockerfile_steps LANG: one instruction per line (comments dropped,
# continuations joined), as Docker reads them.
dockerfile_steps() {
  sed -e '/^[[:space:]]*#/d' "$HERE/$1/Dockerfile" | sed -e ':a' -e '/\\$/N; s/\\\n/ /; ta' | sed -e '/^[[:space:]]*$/d'
}

# copy_into ROOT DST SRC...: Docker's COPY (a directory's contents, files into
# a directory when DST ends in /), owned by root.
copy_into() {
  local root="$1" dst="$2"; shift 2
  local target="$root$dst" s
  if [ "${dst%/}" != "$dst" ] || [ $# -gt 1 ]; then mkdir -p "$target"; fi
  for s in "$@"; do
    if [ -d "$s" ]; then mkdir -p "$target"; cp -a "$s/." "$target/"
    else mkdir -p "$(dirname "$target")"; cp -a "$s" "$target"; fi
  done
  chown -R root:root "$target"
}

from_debootstrap() {
  local lang="$1" ctx="$TMP/ctx-$lang" stage="" n=0 wd="/" line instr rest
  declare -A STAGES=()
  STAGE_ENV=(PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root)
  local image_env=() label=""
  base_tarball
  cp -a "$HERE/$lang" "$ctx"
  cp "$HERE/fetch-verified.mjs" "$ctx/"
  [ -s "$NPM_CA_BUNDLE" ] && cp "$NPM_CA_BUNDLE" "$ctx/host-ca.crt"
  BUILD="$(mktemp -d "$DIR/.build-$lang.XXXXXX")"
  chmod 0700 "$BUILD"
  while IFS= read -r line; do
    read -r instr rest <<<"$line"
    case "${instr^^}" in
      FROM)
        # shellcheck disable=SC2086
        set -- $rest
        [ "$1" = debian:bookworm-slim ] || die "$lang: FROM $1: only debian:bookworm-slim is supported without Docker"
        n=$((n + 1)); stage="$BUILD/stage$n"; wd="/"
        mkdir -p "$stage"; tar -x -C "$stage" --numeric-owner -f "$BASE_TAR"
        cp /etc/resolv.conf "$stage/etc/resolv.conf"
        mount -t proc proc "$stage/proc"; MOUNTS+=("$stage/proc")
        if [ $# -ge 3 ] && [ "${2^^}" = AS ]; then STAGES[$3]="$stage"; fi
        STAGE_ENV=(PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root)
        image_env=(PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin) ;;
      ARG) STAGE_ENV+=("$rest") ;;
      ENV)
        local kvs=()
        read -ra kvs <<<"$rest"
        STAGE_ENV+=("${kvs[@]}"); image_env+=("${kvs[@]}") ;;
      LABEL)
        label="$(sed -n 's/.*sandbox\.language="\([a-z0-9_-]*\)".*/\1/p' <<<"$rest")" ;;
      WORKDIR) wd="$rest" ;;
      RUN) log "$lang: RUN ${rest:0:70}..."; chroot_run "$stage" "$wd" "$rest" ;;
      COPY)
        local from="" args=() src=() a
        # shellcheck disable=SC2086
        set -- $rest
        if [[ "$1" == --from=* ]]; then from="${STAGES[${1#--from=}]:-}"; [ -n "$from" ] || die "$lang: unknown stage in $1"; shift; fi
        args=("$@"); local dst="${args[-1]}"; unset 'args[-1]'
        for a in "${args[@]}"; do
          if [ -n "$from" ]; then src+=("$from$a"); else
            # globs like host-ca.cr[t] match an optional file
            shopt -s nullglob; local g=("$ctx"/$a); shopt -u nullglob
            [ ${#g[@]} -gt 0 ] || [[ "$a" == *[* ]] || die "$lang: COPY $a: no such file in runners/$lang"
            src+=("${g[@]}")
          fi
        done
        [ "${dst:0:1}" = / ] || dst="$wd/$dst"
        copy_into "$stage" "$dst" "${src[@]}" ;;
      USER|ENTRYPOINT|CMD) ;; # the broker supplies the command and the uid
      *) die "$lang: Dockerfile instruction $instr is not supported without Docker" ;;
    esac
  done < <(dockerfile_steps "$lang")
  [ "$label" = "$lang" ] || die "$lang: the Dockerfile's sandbox.language label is '$label'"
  local m
  for m in "${MOUNTS[@]}"; do umount "$m"; done
  MOUNTS=()
  : >"$stage/etc/resolv.conf"
  mv "$stage" "$BUILD/rootfs"
  rm -rf --one-file-system "$BUILD"/stage*
  local env=() e
  for e in "${image_env[@]}"; do env+=(--env "$e"); done
  "$BROKER" runners seal --dir "$BUILD" --language "$lang" --image "sandbox-broker/runner-$lang:$TAG" --built-by debootstrap "${env[@]}" >&2
  install_generation "$lang" "d$(date -u +%Y%m%d%H%M%S)"
}

declare -A SECS=()
for lang in "${LANGS[@]}"; do
  t0=$(date +%s)
  "from_$FROM" "$lang"
  SECS[$lang]=$(( $(date +%s) - t0 ))
  log "$lang: ${SECS[$lang]}s"
done
"$BROKER" runners verify --dir "$DIR" >&2 || die "the runner file systems do not verify (rebuild with --force)"
