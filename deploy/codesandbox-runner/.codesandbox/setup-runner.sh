#!/usr/bin/env bash
# Installs what sandbox-broker's hosted sessions run (SANDBOX_BACKEND=codesandbox):
# python3 with the data stack the Docker runner has, node with tsx, bash, and
# util-linux. The broker's helper needs python3 (standard library only); taking
# the network away from commands (CSB_VM_NETWORK=deny) needs network namespaces,
# or user namespaces for a non-root user. Idempotent: setup tasks run again
# after a clean boot.
set -euo pipefail
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
missing=()
command -v python3 >/dev/null || missing+=(python3)
python3 -c 'import numpy, pandas, matplotlib' 2>/dev/null || missing+=(python3-numpy python3-pandas python3-matplotlib)
command -v node >/dev/null || missing+=(nodejs npm)
command -v unshare >/dev/null || missing+=(util-linux)
if [ "${#missing[@]}" -gt 0 ]; then
  as_root apt-get update
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
fi
command -v tsx >/dev/null || as_root npm install -g tsx@4
# Check what the broker relies on, so a broken template fails its build.
python3 -I -S -c 'import ctypes, json, subprocess, threading'
for cmd in python3 node tsx bash; do command -v "$cmd" >/dev/null; done
if ! python3 -c 'import ctypes; l = ctypes.CDLL(None, use_errno=True); raise SystemExit(0 if l.unshare(0x40000000) == 0 or l.unshare(0x50000000) == 0 else 1)'; then
  echo "warning: commands in this VM cannot be taken off the network; the broker refuses runs unless CSB_VM_NETWORK=allow" >&2
fi
