#!/usr/bin/env bash
# test-images.sh - smoke-test the runner images after runners/build.sh.
#
# Usage: runners/test-images.sh [python|typescript|bash|node|agent ...]   (default: all)
# Env:   RUNNER_TAG (default latest)
#
# Every workload runs the way the broker runs sandboxes: no network, read-only
# rootfs, tmpfs /tmp, all capabilities dropped, no-new-privileges, uid 1000,
# and a host temp dir bind-mounted at /mnt/data. Exits non-zero on any failure.
set -euo pipefail

ALL_LANGS=(python typescript bash node agent)
TAG="${RUNNER_TAG:-latest}"
LANGS=("$@")
[ ${#LANGS[@]} -gt 0 ] || LANGS=("${ALL_LANGS[@]}")

FAILS=0
PASSES=0
pass() { PASSES=$((PASSES + 1)); printf '  ok    %s\n' "$*"; }
fail() { FAILS=$((FAILS + 1)); printf '  FAIL  %s\n' "$*"; }

TMPROOT="$(mktemp -d "${TMPDIR:-/tmp}/runner-test.XXXXXX")"
trap 'rm -rf "$TMPROOT"' EXIT

# The hardened run: what the broker's HostConfig does (security-cases.md §1.2).
hardened() {  # hardened <image> <datadir> <cmd...>
  local image="$1" data="$2"; shift 2
  docker run --rm --network none --read-only --tmpfs /tmp \
    --cap-drop ALL --security-opt no-new-privileges --pids-limit 256 \
    --user 1000:1000 -v "$data:/mnt/data" "$image" "$@"
}

# check <description> <expected> <cmd...> : stdout of cmd (trimmed) must equal expected
check() {
  local desc="$1" want="$2" got; shift 2
  if got="$("$@" 2>"$TMPROOT/stderr")"; then
    if [ "$got" = "$want" ]; then pass "$desc"; return 0; fi
    fail "$desc: expected '$want', got '$got'"
  else
    fail "$desc: command failed (exit $?): $(tail -n 5 "$TMPROOT/stderr" | tr '\n' ' ')"
  fi
  return 0   # failures are counted, not fatal: run every check
}

test_python() {
  local image="$1" data="$2"
  cat >"$data/smoke.py" <<'EOF'
import time, warnings
t0 = time.time()
import numpy as np, pandas as pd, scipy.stats, seaborn as sns, openpyxl
import matplotlib
import matplotlib.pyplot as plt
from reportlab.lib.pagesizes import A4
from reportlab.pdfgen import canvas

assert matplotlib.get_backend().lower() == "agg", matplotlib.get_backend()
df = pd.DataFrame({"x": np.arange(50), "y": np.random.default_rng(1).normal(size=50).cumsum()})
df["z"] = scipy.stats.zscore(df["y"])
fig, ax = plt.subplots(figsize=(4, 3))
sns.lineplot(data=df, x="x", y="y", ax=ax)
ax.set_title("smoke test")
fig.savefig("/mnt/data/plot.png", dpi=80)
df.to_excel("/mnt/data/table.xlsx", index=False)
c = canvas.Canvas("/mnt/data/report.pdf", pagesize=A4)
c.drawString(72, 800, "sandbox-broker smoke test: mean y = %.3f" % df["y"].mean())
c.drawImage("/mnt/data/plot.png", 72, 500, width=320, height=240)
c.save()
print("python ok %.2fs" % (time.time() - t0))
EOF
  local out
  if out="$(hardened "$image" "$data" python3 /mnt/data/smoke.py 2>"$TMPROOT/py.err")"; then
    case "$out" in "python ok "*) pass "pandas/seaborn/scipy/openpyxl/reportlab script ($out)";;
      *) fail "python script printed: $out";; esac
  else
    fail "python script failed: $(tail -n 8 "$TMPROOT/py.err" | tr '\n' ' ')"
  fi
  if grep -qiE 'font cache|temporary cache directory|Matplotlib is building' "$TMPROOT/py.err"; then
    fail "matplotlib rebuilt its font cache / used a temp config dir: $(head -n 3 "$TMPROOT/py.err" | tr '\n' ' ')"
  else
    pass "matplotlib used the pre-built font cache (no warnings)"
  fi
  check "plot.png is a PNG"      'PNG'      sh -c "head -c 4 '$data/plot.png' | tail -c 3"
  check "report.pdf is a PDF"    '%PDF-'    head -c 5 "$data/report.pdf"
  check "table.xlsx is a zip"    'PK'       head -c 2 "$data/table.xlsx"
  check "output files owned by uid 1000" 1000 stat -c %u "$data/report.pdf"
}

test_typescript() {
  local image="$1" data="$2"
  cat >"$data/smoke.ts" <<'EOF'
interface Point { x: number; y: number }
const norm = (p: Point): number => Math.hypot(p.x, p.y);
import { writeFileSync } from "node:fs";
const msg: string = `ts ok ${norm({ x: 3, y: 4 })}`;
writeFileSync("/mnt/data/ts-out.txt", msg + "\n");
console.log(msg);
EOF
  printf 'console.log("js ok " + [1, 2, 3].map((n) => n * 2).join(","));\n' >"$data/smoke.js"
  check "tsx runs a .ts file with type annotations" "ts ok 5" hardened "$image" "$data" tsx /mnt/data/smoke.ts
  check "ts alias runs a .ts file"                  "ts ok 5" hardened "$image" "$data" ts /mnt/data/smoke.ts
  check "node runs a .js file"                      "js ok 2,4,6" hardened "$image" "$data" node /mnt/data/smoke.js
  check "tsc is present"                            "ok" hardened "$image" "$data" sh -c 'tsc --version >/dev/null && echo ok'
  check ".ts output written to /mnt/data"           "ts ok 5" cat "$data/ts-out.txt"
}

test_bash() {
  local image="$1" data="$2"
  check "bash: echo ok"        ok hardened "$image" "$data" bash -c 'echo ok'
  check "bash: jq works"       3  hardened "$image" "$data" bash -c 'echo "{\"a\":[1,2,3]}" | jq ".a | length"'
  check "bash: writes /data"   ok hardened "$image" "$data" bash -c 'echo ok >/data/b.txt && cat /mnt/data/b.txt'
}

# The agent runner: both CLIs start under the hardened run (read-only root,
# HOME on the noexec /tmp), and the tools an agent's shell reaches for are
# there. Whole tasks against a fake model are tests/agent_test.go's.
test_agent() {
  local image="$1" data="$2"
  check "claude --version"   "2.1.331 (Claude Code)" hardened "$image" "$data" sh -c 'HOME=/tmp claude --version'
  check "opencode --version" "1.18.33"               hardened "$image" "$data" sh -c 'HOME=/tmp opencode --version'
  check "python data stack"  ok hardened "$image" "$data" python3 -c 'import numpy, pandas, scipy, matplotlib, seaborn, openpyxl, reportlab; print("ok")'
  check "node, git, curl, jq, rg" ok hardened "$image" "$data" sh -c 'node -e 1 && git --version >/dev/null && curl --version >/dev/null && jq --version >/dev/null && rg --version >/dev/null && echo ok'
  check "git commits in /mnt/data" ok hardened "$image" "$data" sh -c 'cd /mnt/data && HOME=/tmp git init -q r && cd r && echo x >f && git add f && HOME=/tmp git -c user.name=a -c user.email=a@b commit -qm m && echo ok'
}

# Each starter is laid out the way the local project provider does it: its
# files copied to /mnt/data (without node_modules) and node_modules a symlink
# into the image. The build must work with no network, within the project
# limits (0.5 CPU, 512 MiB).
test_node() {
  local image="$1" data="$2" s d out want t0
  check "npm is present"    ok hardened "$image" "$data" sh -c 'npm --version >/dev/null && echo ok'
  for s in react vue next node; do
    d="$data/starter-$s"
    mkdir -p "$d"; chown 1000:1000 "$d" 2>/dev/null || chmod 0777 "$d"
    t0=$(date +%s)
    if out="$(docker run --rm --network none --read-only --tmpfs /tmp --cap-drop ALL \
          --security-opt no-new-privileges --pids-limit 256 --memory 512m --memory-swap 512m --cpus 0.5 \
          --user 1000:1000 -e HOME=/tmp -v "$d:/mnt/data" "$image" bash -c "
            set -e
            cd /opt/starters/$s && tar --exclude=./node_modules -cf - . | tar -xf - -C /mnt/data
            ln -s /opt/starters/$s/node_modules /mnt/data/node_modules
            cd /mnt/data && npm run build 2>&1" 2>&1)"; then
      pass "$s: npm run build with --network none, 0.5 CPU, 512 MiB ($(( $(date +%s) - t0 ))s)"
    else
      fail "$s: npm run build failed: $(printf '%s' "$out" | tail -n 8 | tr '\n' ' ')"
    fi
    case "$s" in react|vue) want="$d/dist/index.html" ;; next) want="$d/out/index.html" ;; node) want="$d/server.js" ;; esac
    if [ -s "$want" ]; then pass "$s: ${want#"$d"/} exists"; else fail "$s: ${want#"$d"/} missing after the build"; fi
  done
  if [ -s "$data/starter-react/dist/index.html" ]; then
    check "react: built index.html uses relative asset URLs (base './')" yes \
      sh -c "grep -q 'src=\"./assets/' '$data/starter-react/dist/index.html' && echo yes || echo no"
  fi
  if [ -s "$data/starter-next/out/index.html" ]; then
    check "next: exported index.html uses relative _next URLs (assetPrefix './')" yes \
      sh -c "grep -q '\"./_next/' '$data/starter-next/out/index.html' && echo yes || echo no"
  fi
  check "node: server.js answers on \$PREVIEW_SOCKET" "200 Hello from Node.js" hardened "$image" "$data/starter-node" node -e '
    const { spawn } = require("node:child_process"), http = require("node:http"), fs = require("node:fs");
    const sock = "/tmp/preview.sock";
    const srv = spawn("node", ["/mnt/data/server.js"], { env: { ...process.env, PREVIEW_SOCKET: sock }, stdio: ["ignore", "pipe", "inherit"] });
    srv.stdout.once("data", () => {
      http.get({ socketPath: sock, path: "/" }, (res) => {
        let b = ""; res.on("data", (c) => (b += c));
        res.on("end", () => { console.log(res.statusCode + " " + (b.match(/<h1>([^<]*)<\/h1>/) || [])[1]); srv.kill(); });
      }).on("error", (e) => { console.error(e.message); srv.kill(); process.exit(1); });
    });
    setTimeout(() => { console.error("no answer"); srv.kill(); process.exit(1); }, 20000).unref();'
}

for lang in "${LANGS[@]}"; do
  image="sandbox-broker/runner-$lang:$TAG"
  echo "== $image"
  if ! docker image inspect "$image" >/dev/null 2>&1; then
    fail "$image does not exist (run runners/build.sh $lang)"
    continue
  fi
  data="$TMPROOT/$lang"
  mkdir -p "$data"
  chown 1000:1000 "$data" 2>/dev/null || chmod 0777 "$data"

  # image metadata
  check "label sandbox.runner=true"        true  docker image inspect -f '{{index .Config.Labels "sandbox.runner"}}' "$image"
  check "label sandbox.language=$lang"     "$lang" docker image inspect -f '{{index .Config.Labels "sandbox.language"}}' "$image"
  check "image USER is 1000:1000"          1000:1000 docker image inspect -f '{{.Config.User}}' "$image"
  check "image WORKDIR is /mnt/data"       /mnt/data docker image inspect -f '{{.Config.WorkingDir}}' "$image"
  check "no ENTRYPOINT and no CMD"         "null null" docker image inspect -f '{{json .Config.Entrypoint}} {{json .Config.Cmd}}' "$image"
  # identity and filesystem layout, under the hardened run
  check "id -u is 1000"                    1000 hardened "$image" "$data" id -u
  check "id -g is 1000"                    1000 hardened "$image" "$data" id -g
  check "HOME is /home/sandbox"            /home/sandbox hardened "$image" "$data" sh -c 'echo $HOME'
  check "cwd is /mnt/data"                 /mnt/data hardened "$image" "$data" pwd
  check "/data -> /mnt/data"               /mnt/data hardened "$image" "$data" readlink /data
  check "/opt/sandbox is root 755"         "root 755" hardened "$image" "$data" stat -c '%U %a' /opt/sandbox
  check "rootfs is read-only"              ro hardened "$image" "$data" sh -c 'touch /etc/x 2>/dev/null && echo rw || echo ro'
  check "/tmp is writable"                 ok hardened "$image" "$data" sh -c 'touch /tmp/x && echo ok'
  check "no CA bundle in the image"        none hardened "$image" "$data" sh -c 'ls /etc/ssl/certs/ca-certificates.crt /build 2>/dev/null || echo none'
  check "no apt lists/caches"              0 hardened "$image" "$data" sh -c 'ls -A /var/lib/apt/lists /var/cache/apt 2>/dev/null | grep -v -e "^$" -e ":$" -e "^lock$" -e "^partial$" -e "^auxfiles$" | wc -l'
  # setuid/setgid: scan as root (can read every directory), caps left default
  check "no setuid/setgid files (find / -xdev -perm /6000)" "" \
    docker run --rm --network none --read-only --user 0:0 "$image" find / -xdev -perm /6000

  "test_$lang" "$image" "$data"
done

echo
echo "passed: $PASSES  failed: $FAILS"
[ "$FAILS" = 0 ]
