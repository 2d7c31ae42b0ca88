#!/usr/bin/env bash
# cluster.sh - a real single-node Kubernetes for the kubernetes backend's
# tests, built offline: kube-apiserver, controller-manager, scheduler,
# kubelet and kubectl from the Go module proxy (build/: a wrapper module
# around k8s.io/kubernetes with its staging modules pinned), with Debian's
# containerd, runc, CNI plugins and etcd. The node runs its own containerd
# (own root, state and socket under K8S_DIR): Docker's daemon and its
# containerd are never touched.
#
# Usage: tests/k8s/cluster.sh COMMAND
#   build             build the binaries into $K8S_DIR/bin, helm and agent-sandbox's controller too
#                     (cached: a no-op when build/ and the pinned versions are unchanged)
#   up                start the cluster (certificates, pause image, containerd, etcd, control plane, kubelet)
#   down              stop it: pods deleted while the kubelet runs, processes by PID, containers, mounts,
#                     the CNI bridge and the chains the kubelet made
#   load FILE         import an image archive (OCI or docker save) into the node
#   load-docker IMG.. import images from the Docker daemon (docker save | ctr import)
#   agent-sandbox     install kubernetes-sigs/agent-sandbox (CRDs, controller on the host; cached build)
#                     into this cluster, or the one KUBECONFIG names
#   helm              build helm into $K8S_DIR/bin (cached), for the chart's test
#   kubeconfig        print the admin kubeconfig's path
#
# Environment: K8S_DIR (default ${XDG_CACHE_HOME:-$HOME/.cache}/sandbox-broker/k8s) holds the binaries,
# the Go caches (gocache, gomod) and the cluster's state; NODE_IP (default: the source address of the
# default route); ETCD (default /usr/bin/etcd, Debian's etcd-server).
# Gotchas of this kind of VM (see README.md): no CAP_SYS_RESOURCE (restrict_oom_score_adj in
# etc/containerd.toml), cgroup v1 (failCgroupV1: false in etc/kubelet.yaml).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
: "${K8S_DIR:=${XDG_CACHE_HOME:-$HOME/.cache}/sandbox-broker/k8s}"
K=$K8S_DIR B=$K8S_DIR/bin R=$K8S_DIR/run L=$K8S_DIR/logs P=$K8S_DIR/pki
ETCD=${ETCD:-/usr/bin/etcd}
AGENT_SANDBOX_VERSION=$(awk '$1=="require" && $2=="sigs.k8s.io/agent-sandbox" {print $3}' "$HERE/agent-sandbox/go.mod")
SOCK=$K/containerd/containerd.sock
CTR="ctr -a $SOCK -n k8s.io"
HELM_VERSION=v3.22.0
# kubectl and the kubeconfig: this cluster's, unless KUBECONFIG names another (agent-sandbox on kind).
KC="$( [ -x "$B/kubectl" ] && echo "$B/kubectl" || echo kubectl) --kubeconfig ${KUBECONFIG:-$K/kubeconfig}"
FWD="-i k8sci0 -o k8sci0 -m comment --comment sandbox-broker-k8s -j ACCEPT"
COMPONENTS="kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl"

log() { printf '[k8s] %s\n' "$*" >&2; }
die() { printf '[k8s] ERROR: %s\n' "$*" >&2; exit 1; }
node_ip() {
  echo "${NODE_IP:-$(ip -4 route get 1.1.1.1 2>/dev/null | awk '{for(i=1;i<=NF;i++) if($i=="src") print $(i+1)}')}"
}

have_binaries() { local n; for n in $COMPONENTS; do [ -x "$B/$n" ] || return 1; done; }

cmd_build() {
  local stamp want start ver ldflags pkg
  # The version the binaries report (kubectl version, discovery, helm's kubeVersion check): the
  # release's, as its own build stamps it, not the source tree's placeholder v0.0.0-master.
  ver=$(awk '$1=="require" && $2=="k8s.io/kubernetes" {print $3}' "$HERE/build/go.mod")
  ldflags="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$ver -X $pkg.gitMajor=$(echo "${ver#v}" | cut -d. -f1)"
    ldflags+=" -X $pkg.gitMinor=$(echo "$ver" | cut -d. -f2) -X $pkg.gitTreeState=clean"
  done
  want=$( (cat "$HERE/build/go.mod" "$HERE/build/go.sum"; echo "$ldflags") | sha256sum | cut -d' ' -f1)
  stamp=$(cat "$B/.stamp" 2>/dev/null || true)
  if [ "$stamp" = "$want" ] && have_binaries; then
    log "binaries cached in $B"; return 0
  fi
  mkdir -p "$B" "$K/build"
  cp "$HERE/build/go.mod" "$HERE/build/go.sum" "$K/build/"
  # One go build for all of them: packages compile once, links run side by side.
  start=$(date +%s)
  (cd "$K/build" && GOMODCACHE=$K/gomod GOCACHE=$K/gocache GOFLAGS=-mod=mod CGO_ENABLED=0 \
    nice -n 10 go build -trimpath -ldflags="$ldflags" -o "$B/" $(for n in $COMPONENTS; do echo "k8s.io/kubernetes/cmd/$n"; done))
  log "built $COMPONENTS in $(( $(date +%s) - start ))s"
  echo "$want" > "$B/.stamp"
}

# oci_image NAME BINARY PATH OUT: an OCI archive OUT of image NAME holding BINARY at PATH, its entrypoint.
oci_image() {
  local name=$1 bin=$2 path=$3 out=$4 w l ls c cs m ms
  w=$(mktemp -d)
  mkdir -p "$w/oci/blobs/sha256" "$w/rootfs$(dirname "$path")"
  cp "$bin" "$w/rootfs$path"
  tar --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$w/rootfs" -cf "$w/layer.tar" "${path#/}"
  l=$(sha256sum "$w/layer.tar" | cut -d' ' -f1); ls=$(stat -c %s "$w/layer.tar"); mv "$w/layer.tar" "$w/oci/blobs/sha256/$l"
  printf '{"architecture":"amd64","os":"linux","config":{"Entrypoint":["%s"]},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' "$path" "$l" > "$w/cfg.json"
  c=$(sha256sum "$w/cfg.json" | cut -d' ' -f1); cs=$(stat -c %s "$w/cfg.json"); mv "$w/cfg.json" "$w/oci/blobs/sha256/$c"
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:%s","size":%s}]}' "$c" "$cs" "$l" "$ls" > "$w/m.json"
  m=$(sha256sum "$w/m.json" | cut -d' ' -f1); ms=$(stat -c %s "$w/m.json"); mv "$w/m.json" "$w/oci/blobs/sha256/$m"
  printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' "$m" "$ms" "$name" "${name##*:}" > "$w/oci/index.json"
  echo '{"imageLayoutVersion":"1.0.0"}' > "$w/oci/oci-layout"
  tar -C "$w/oci" -cf "$out" oci-layout index.json blobs
  rm -rf "$w"
}

certs() {
  local ip=$1
  rm -rf "$P"; mkdir -p "$P"
  (cd "$P"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 30 -subj "/CN=sandbox-broker-test-ca" 2>/dev/null
  printf 'subjectAltName=DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:10.96.0.1,IP:%s\nextendedKeyUsage=serverAuth\n' "$ip" > apiserver.ext
  openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj "/CN=kube-apiserver" 2>/dev/null
  openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out apiserver.crt -days 30 -extfile apiserver.ext 2>/dev/null
  # One system:masters client certificate for every component: a test cluster's shortcut.
  echo "extendedKeyUsage=clientAuth" > client.ext
  openssl req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr -subj "/O=system:masters/CN=admin" 2>/dev/null
  openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out admin.crt -days 30 -extfile client.ext 2>/dev/null
  openssl genrsa -out sa.key 2048 2>/dev/null
  openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null)
  cat > "$K/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster: {server: "https://127.0.0.1:6443", certificate-authority: $P/ca.crt}
users:
- name: admin
  user: {client-certificate: $P/admin.crt, client-key: $P/admin.key}
contexts:
- name: local
  context: {cluster: local, user: admin}
current-context: local
EOF
}

start() { local n=$1; shift; nohup "$@" > "$L/$n.log" 2>&1 & echo $! > "$R/$n.pid"; }
wait_for() { # name command timeout
  local i
  for i in $(seq 1 "${3:-60}"); do eval "$2" >/dev/null 2>&1 && return 0; sleep 1; done
  log "timeout waiting for $1"; tail -20 "$L/$1.log" >&2 || true; exit 1
}
running() { [ -f "$R/$1.pid" ] && kill -0 "$(cat "$R/$1.pid")" 2>/dev/null; }

cmd_up() {
  local ip t0 f pause
  t0=$(date +%s%N)
  have_binaries || die "binaries missing in $B: run $0 build"
  [ -x "$ETCD" ] || die "etcd not found at $ETCD (apt-get install etcd-server)"
  [ -d /usr/lib/cni ] || die "CNI plugins missing (apt-get install containernetworking-plugins)"
  running kube-apiserver && die "already up (run $0 down first)"
  ip=$(node_ip); [ -n "$ip" ] || die "no node IP (set NODE_IP)"
  mkdir -p "$R" "$L" "$K/etc" "$K/cni/net.d" "$K/containerd" "$K/kubelet/seccomp"
  rm -rf "$K/etcd-data" "$K/cni/ipam"
  sed "s#@K8S_DIR@#$K#g" "$HERE/etc/containerd.toml" > "$K/etc/containerd.toml"
  sed "s#@K8S_DIR@#$K#g" "$HERE/etc/kubelet.yaml" > "$K/etc/kubelet.yaml"
  sed "s#@K8S_DIR@#$K#g" "$HERE/etc/10-bridge.conflist" > "$K/cni/net.d/10-bridge.conflist"
  certs "$ip"

  # Docker sets the FORWARD policy to DROP and br_netfilter sends bridged frames through it: let
  # pods on the node's bridge reach each other (the broker's pod its sandboxes), nothing more.
  iptables -C FORWARD $FWD 2>/dev/null || iptables -I FORWARD $FWD
  running containerd || start containerd containerd --config "$K/etc/containerd.toml"
  wait_for containerd "ctr -a $SOCK version"
  if ! $CTR images ls -q | grep -qx 'localhost/pause:ci'; then
    pause=$(mktemp -d)
    (cd "$HERE/pause" && CGO_ENABLED=0 GOCACHE=$K/gocache go build -trimpath -ldflags='-s -w' -o "$pause/pause" .)
    oci_image localhost/pause:ci "$pause/pause" /pause "$pause/pause.tar"
    $CTR images import "$pause/pause.tar" >/dev/null
    rm -rf "$pause"
  fi

  start etcd "$ETCD" --name ci --data-dir "$K/etcd-data" --listen-client-urls http://127.0.0.1:2379 \
    --advertise-client-urls http://127.0.0.1:2379 --listen-peer-urls http://127.0.0.1:2380 \
    --initial-advertise-peer-urls http://127.0.0.1:2380 --initial-cluster ci=http://127.0.0.1:2380
  wait_for etcd "curl -sf http://127.0.0.1:2379/health"

  start kube-apiserver "$B/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
    --advertise-address="$ip" --secure-port=6443 \
    --tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" --client-ca-file="$P/ca.crt" \
    --service-account-key-file="$P/sa.pub" --service-account-signing-key-file="$P/sa.key" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-cluster-ip-range=10.96.0.0/16 --authorization-mode=Node,RBAC --allow-privileged=true \
    --kubelet-client-certificate="$P/admin.crt" --kubelet-client-key="$P/admin.key"
  wait_for kube-apiserver "curl -sf --cacert $P/ca.crt --cert $P/admin.crt --key $P/admin.key https://127.0.0.1:6443/readyz" 120

  start kube-controller-manager "$B/kube-controller-manager" --kubeconfig="$K/kubeconfig" \
    --authentication-kubeconfig="$K/kubeconfig" --authorization-kubeconfig="$K/kubeconfig" \
    --service-account-private-key-file="$P/sa.key" --root-ca-file="$P/ca.crt" \
    --cluster-signing-cert-file="$P/ca.crt" --cluster-signing-key-file="$P/ca.key" \
    --use-service-account-credentials=true --leader-elect=false --bind-address=127.0.0.1
  start kube-scheduler "$B/kube-scheduler" --kubeconfig="$K/kubeconfig" \
    --authentication-kubeconfig="$K/kubeconfig" --authorization-kubeconfig="$K/kubeconfig" \
    --leader-elect=false --bind-address=127.0.0.1
  start kubelet "$B/kubelet" --config="$K/etc/kubelet.yaml" --kubeconfig="$K/kubeconfig" \
    --root-dir="$K/kubelet" --cert-dir="$K/kubelet/pki" --hostname-override="$(hostname)" --node-ip="$ip"
  wait_for kubelet "$KC get node $(hostname) -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -q True" 120
  wait_for kube-controller-manager "$KC -n default get sa default" 60
  log "cluster up in $(( ($(date +%s%N) - t0) / 1000000 )) ms (kubeconfig $K/kubeconfig, node $ip)"
}

stop() {
  local p
  [ -f "$R/$1.pid" ] || return 0
  p=$(cat "$R/$1.pid"); kill "$p" 2>/dev/null || true
  for _ in $(seq 20); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done
  kill -0 "$p" 2>/dev/null && kill -9 "$p" 2>/dev/null
  rm -f "$R/$1.pid"
}

cmd_down() {
  local t h ipt tab c
  stop agent-sandbox-controller
  # The kubelet tears pod sandboxes down (CNI DEL, netns, mounts) while it runs.
  if running kubelet && running kube-apiserver; then
    timeout 90 $KC delete pod --all -A --grace-period=0 --force --wait=true >/dev/null 2>&1 || true
  fi
  for n in kubelet kube-scheduler kube-controller-manager kube-apiserver etcd; do stop "$n"; done
  if [ -S "$SOCK" ]; then
    for t in $($CTR task ls -q 2>/dev/null); do $CTR task kill -s KILL "$t" 2>/dev/null || true; done
    for t in $($CTR task ls -q 2>/dev/null); do $CTR task delete -f "$t" 2>/dev/null || true; done
    for c in $($CTR containers ls -q 2>/dev/null); do $CTR containers rm "$c" 2>/dev/null || true; done
  fi
  stop containerd
  grep -E " $K/(kubelet|containerd)" /proc/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
  while iptables -D FORWARD $FWD 2>/dev/null; do :; done
  ip link del k8sci0 2>/dev/null || true
  for h in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods; do
    [ -d "$h" ] && find "$h" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
  # Chains the kubelet made, and any a CNI DEL missed (the bridge plugin's masquerade chains).
  for ipt in iptables ip6tables; do
    $ipt -D INPUT -j KUBE-FIREWALL 2>/dev/null || true
    $ipt -D OUTPUT -j KUBE-FIREWALL 2>/dev/null || true
    for tab in filter nat mangle; do
      for c in KUBE-FIREWALL KUBE-KUBELET-CANARY KUBE-IPTABLES-HINT; do
        $ipt -t "$tab" -F "$c" 2>/dev/null || true; $ipt -t "$tab" -X "$c" 2>/dev/null || true
      done
    done
    for c in $($ipt -t nat -S 2>/dev/null | awk '$1=="-N" && $2 ~ /^CNI-/ {print $2}'); do
      $ipt -t nat -S POSTROUTING | grep -- "-j $c" | sed 's/^-A/-D/' | while read -r rule; do eval "$ipt -t nat $rule" 2>/dev/null || true; done # -S quotes the comment
      $ipt -t nat -F "$c" 2>/dev/null || true; $ipt -t nat -X "$c" 2>/dev/null || true
    done
  done
  log "down"
}

cmd_load() {
  [ -f "${1:-}" ] || die "usage: $0 load ARCHIVE"
  $CTR images import "$1" >/dev/null
}

cmd_load_docker() {
  local img
  for img in "$@"; do
    docker image inspect "$img" >/dev/null 2>&1 || die "no image $img in the Docker daemon (runners/build.sh)"
    docker save "$img" | $CTR images import - >/dev/null
    log "loaded $img"
  done
}

# build_agent_sandbox: agent-sandbox's controller, built in a wrapper module (agent-sandbox/: go.mod and
# go.sum pinned), not with "go install pkg@version": that asks the proxy for the module's version list,
# which it refuses for this module (403).
build_agent_sandbox() {
  local start
  [ -x "$B/agent-sandbox-controller-$AGENT_SANDBOX_VERSION" ] && return 0
  start=$(date +%s)
  mkdir -p "$B" "$K/agent-sandbox-build"
  cp "$HERE/agent-sandbox/go.mod" "$HERE/agent-sandbox/go.sum" "$K/agent-sandbox-build/"
  (cd "$K/agent-sandbox-build" && GOMODCACHE=$K/gomod GOCACHE=$K/gocache GOFLAGS=-mod=mod CGO_ENABLED=0 \
    nice -n 10 go build -trimpath -ldflags='-s -w' -o "$B/agent-sandbox-controller-$AGENT_SANDBOX_VERSION" \
    sigs.k8s.io/agent-sandbox/cmd/agent-sandbox-controller)
  log "built agent-sandbox-controller $AGENT_SANDBOX_VERSION in $(( $(date +%s) - start ))s"
}

# agent-sandbox: the CRDs of its module (served as v1beta1 only: the conversion webhook is
# for v1alpha1, which nothing here uses) and its controller, run on the host with the admin
# kubeconfig and the extensions (SandboxClaim, SandboxWarmPool) on.
cmd_agent_sandbox() {
  local mod f
  build_agent_sandbox
  mod=$(GOMODCACHE=$K/gomod GOFLAGS=-mod=mod go mod download -json "sigs.k8s.io/agent-sandbox@$AGENT_SANDBOX_VERSION" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
  for f in "$mod"/k8s/crds/*.yaml; do
    /usr/bin/python3 - "$f" <<'PY' | $KC apply --server-side -f - >/dev/null
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
doc["spec"].pop("conversion", None)  # strategy None
doc["spec"]["versions"] = [v for v in doc["spec"]["versions"] if v["name"] == "v1beta1"]
for v in doc["spec"]["versions"]:
    v["storage"] = True
print(yaml.safe_dump(doc))
PY
  done
  $KC wait --for=condition=Established crd --all --timeout=60s >/dev/null
  mkdir -p "$R" "$L"
  running agent-sandbox-controller || start agent-sandbox-controller "$B/agent-sandbox-controller-$AGENT_SANDBOX_VERSION" \
    --kubeconfig="${KUBECONFIG:-$K/kubeconfig}" --extensions --enable-webhook=false --leader-elect=false \
    --metrics-bind-address=0 --health-probe-bind-address=0
  sleep 1
  running agent-sandbox-controller || { tail -20 "$L/agent-sandbox-controller.log" >&2; die "agent-sandbox-controller did not start"; }
  log "agent-sandbox $AGENT_SANDBOX_VERSION installed"
}

cmd_helm() {
  local start
  if [ ! -x "$B/helm-$HELM_VERSION" ]; then
    start=$(date +%s)
    mkdir -p "$B"
    GOMODCACHE=$K/gomod GOCACHE=$K/gocache GOBIN=$K/gobin CGO_ENABLED=0 \
      nice -n 10 go install -trimpath -ldflags='-s -w' "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
    mv "$K/gobin/helm" "$B/helm-$HELM_VERSION"
    log "built helm $HELM_VERSION in $(( $(date +%s) - start ))s"
  fi
  ln -sf "helm-$HELM_VERSION" "$B/helm"
}

case "${1:-}" in
  build) cmd_build; cmd_helm; build_agent_sandbox ;;
  up) cmd_up ;;
  down) cmd_down ;;
  load) shift; cmd_load "$@" ;;
  load-docker) shift; cmd_load_docker "$@" ;;
  agent-sandbox) cmd_agent_sandbox ;;
  helm) cmd_helm ;;
  kubeconfig) echo "$K/kubeconfig" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2 ;;
esac
