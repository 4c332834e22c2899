#!/usr/bin/env bash
# Build the real components of the local test control plane from Go modules, cached by version.
#
#   etcd, kube-apiserver, kube-scheduler, kube-controller-manager, kubectl   (k8s.io/kubernetes)
#   kwok                                                                     (sigs.k8s.io/kwok)
#   kuberay ray-operator + its CRDs                                          (github.com/ray-project/kuberay/ray-operator)
#   helm                                                                     (helm.sh/helm/v3)
#   kueue manager + its CRDs, RBAC and webhook configurations                (sigs.k8s.io/kueue)
#   kubelet, kube-proxy (real nodes)                                         (k8s.io/kubernetes)
#   coredns with the plugins a local cluster needs (real nodes)              (github.com/coredns/coredns)
#   agent-sandbox controller + its CRDs and ClusterRoles                      (sigs.k8s.io/agent-sandbox)
#
# Targets: etcd kwok kuberay helm k8s (the default: the control plane), kueue (tests/integration/test_kueue.py),
# agent-sandbox (the sandboxes of agent rollouts, tests/pods/test_sandbox.py)
# and node (kubelet, kube-proxy, coredns: what `localcluster.py up --real-nodes N` needs besides Debian's
# containerd, runc and CNI plugins). The tests' S3 server is not built here: hack/fetch-s3proxy.sh fetches it.
#
# Binaries land in $RLHF_CACHE/bin/<name>-<version>; a symlink farm in $RLHF_CACHE/bin/current/ points at
# the versions pinned here. A version already built is never rebuilt, so reruns take seconds.
# Usage: hack/build-controlplane.sh            (prints the bin dir on the last line)
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.36.3}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.7}"
KWOK_VERSION="${KWOK_VERSION:-v0.8.0}"
# v1.7.0 is the target, but the Go module proxy answers 403 "This module version is not available" for its zip;
# v1.6.2 is the newest KubeRay release the proxy serves.
KUBERAY_VERSION="${KUBERAY_VERSION:-v1.6.2}"
HELM_VERSION="${HELM_VERSION:-v3.19.5}"
COREDNS_VERSION="${COREDNS_VERSION:-v1.15.0}"
# The module proxy lists no Kueue versions but serves exact ones (v0.17.1 yes, v0.18.0 no).
KUEUE_VERSION="${KUEUE_VERSION:-v0.17.1}"
AGENT_SANDBOX_VERSION="${AGENT_SANDBOX_VERSION:-v1.0.1}"

CACHE="${RLHF_CACHE:-$HOME/.cache/rlhf-operator}"
BIN="$CACHE/bin"
WORK="$CACHE/build"
mkdir -p "$BIN/current" "$WORK"
export GOFLAGS="-buildvcs=false -trimpath"
export CGO_ENABLED=0
LDFLAGS="-s -w"

log() { printf '[build-controlplane %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

have() { # have <name> <version>: true when every named binary exists
  local v=$1; shift
  for n in "$@"; do [ -x "$BIN/$n-$v" ] || return 1; done
}

link() { # link <name> <version>
  ln -sfn "$BIN/$1-$2" "$BIN/current/$1"
}

# Write a wrapper go.mod in $1 requiring module $2@$3, with extra go.mod lines on stdin.
wrapper() {
  local dir=$1 mod=$2 ver=$3
  mkdir -p "$dir"
  {
    echo "module rlhf.local/build"
    echo "go 1.26"
    echo "require $mod $ver"
    cat
  } >"$dir/go.mod"
}

# The wrapper module for k8s.io/kubernetes in $1: the module points its staging modules at ./staging, so as a
# dependency they must be pinned. Go itself says where the module's go.mod is (no proxy URL here).
k8s_wrapper() {
  local dir=$1 staging="v0${K8S_VERSION#v1}" gomod mods
  [ -f "$dir/go.mod" ] && return 0
  gomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/^\s*"GoMod": "\(.*\)",\{0,1\}$/\1/p')
  [ -f "$gomod" ] || { log "go mod download gave no go.mod for k8s.io/kubernetes@$K8S_VERSION"; return 1; }
  mods=$(sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$gomod")
  {
    echo "replace ("
    for m in $mods; do echo "  $m => $m $staging"; done
    echo ")"
  } | wrapper "$dir" k8s.io/kubernetes "$K8S_VERSION"
}

# k8s_cmds <name...>: build these commands of k8s.io/kubernetes (cmd/<name>) unless cached, and link them.
k8s_cmds() {
  local names=("$@")
  if have "$K8S_VERSION" "${names[@]}"; then log "${names[*]} $K8S_VERSION cached"; else
    log "building ${names[*]} $K8S_VERSION"
    local dir="$WORK/k8s-$K8S_VERSION"
    k8s_wrapper "$dir"
    (
      cd "$dir"
      for n in "${names[@]}"; do go get "k8s.io/kubernetes/cmd/$n@$K8S_VERSION" >/dev/null 2>&1 || go get "k8s.io/kubernetes/cmd/$n@$K8S_VERSION"; done
      mkdir -p out
      # Stamp the version as the release build does (helm, kubectl and the node read it from /version).
      go build -ldflags "$(k8s_ldflags)" -o out/ $(printf 'k8s.io/kubernetes/cmd/%s ' "${names[@]}")
      for n in "${names[@]}"; do mv "out/$n" "$BIN/$n-$K8S_VERSION"; done
    )
  fi
  for n in "${names[@]}"; do link "$n" "$K8S_VERSION"; done
}

build_k8s() { k8s_cmds kube-apiserver kube-scheduler kube-controller-manager kubectl; }

build_etcd() {
  if have "$ETCD_VERSION" etcd; then log "etcd $ETCD_VERSION cached"; else
    log "building etcd $ETCD_VERSION"
    local dir="$WORK/etcd-$ETCD_VERSION"
    wrapper "$dir" go.etcd.io/etcd/server/v3 "$ETCD_VERSION" </dev/null
    (cd "$dir" && go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" && go build -ldflags "$LDFLAGS" -o "$BIN/etcd-$ETCD_VERSION" go.etcd.io/etcd/server/v3)
  fi
  link etcd "$ETCD_VERSION"
}

build_kwok() {
  local stages="$CACHE/kwok-stages-$KWOK_VERSION.yaml"
  if have "$KWOK_VERSION" kwok && [ -s "$stages" ]; then log "kwok $KWOK_VERSION cached"; else
    log "building kwok $KWOK_VERSION"
    local dir="$WORK/kwok-$KWOK_VERSION"
    wrapper "$dir" sigs.k8s.io/kwok "$KWOK_VERSION" </dev/null
    (
      cd "$dir"
      go get "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
      go build -ldflags "$LDFLAGS" -o "$BIN/kwok-$KWOK_VERSION" sigs.k8s.io/kwok/cmd/kwok
      # KWOK's own "fast" stages: nodes become Ready, pods become Running/Ready and go away when deleted.
      # pod-complete is left out on purpose: the RayJob submitter pod then stays Running, like a live driver.
      src=$(go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)/kustomize/stage
      for f in node/fast/node-initialize.yaml pod/fast/pod-ready.yaml pod/fast/pod-delete.yaml; do
        echo "---"; cat "$src/$f"
      done >"$stages.tmp" && mv "$stages.tmp" "$stages"
    )
  fi
  link kwok "$KWOK_VERSION"
  ln -sfn "$stages" "$BIN/current/kwok-stages.yaml"
}

build_kuberay() {
  local crds="$CACHE/kuberay-crds-$KUBERAY_VERSION"
  if have "$KUBERAY_VERSION" kuberay-operator && [ -d "$crds" ]; then log "kuberay $KUBERAY_VERSION cached"; else
    log "building kuberay ray-operator $KUBERAY_VERSION"
    local dir="$WORK/kuberay-$KUBERAY_VERSION" mod=github.com/ray-project/kuberay/ray-operator
    wrapper "$dir" "$mod" "$KUBERAY_VERSION" </dev/null
    (
      cd "$dir"
      go get "$mod@$KUBERAY_VERSION"
      go build -ldflags "$LDFLAGS" -o "$BIN/kuberay-operator-$KUBERAY_VERSION" "$mod"
      src=$(go list -m -f '{{.Dir}}' "$mod")
      rm -rf "$crds.tmp" && mkdir -p "$crds.tmp" && cp "$src"/config/crd/bases/*.yaml "$crds.tmp/" && chmod -R u+w "$crds.tmp"
      rm -rf "$crds" && mv "$crds.tmp" "$crds"
    )
  fi
  # KubeRay's own ClusterRole, for KubeRay as a pod on real nodes (localcluster.py --real-nodes).
  local rbac="$CACHE/kuberay-rbac-$KUBERAY_VERSION.yaml"
  if [ ! -s "$rbac" ]; then
    local dir
    dir=$(go mod download -json "github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION" | sed -n 's/^\s*"Dir": "\(.*\)",\{0,1\}$/\1/p')
    cp "$dir/config/rbac/role.yaml" "$rbac.tmp" && chmod u+w "$rbac.tmp" && mv "$rbac.tmp" "$rbac"
  fi
  link kuberay-operator "$KUBERAY_VERSION"
  ln -sfn "$crds" "$BIN/current/kuberay-crds"
  ln -sfn "$rbac" "$BIN/current/kuberay-rbac.yaml"
}

build_helm() {
  if have "$HELM_VERSION" helm; then log "helm $HELM_VERSION cached"; else
    log "building helm $HELM_VERSION"
    local dir="$WORK/helm-$HELM_VERSION"
    wrapper "$dir" helm.sh/helm/v3 "$HELM_VERSION" </dev/null
    (cd "$dir" && go get "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" && go build -ldflags "$LDFLAGS" -o "$BIN/helm-$HELM_VERSION" helm.sh/helm/v3/cmd/helm)
  fi
  link helm "$HELM_VERSION"
}

# Kueue's manager (cmd/kueue) and, from the module's config/, its CRDs, the manager ClusterRole and the webhook
# configurations (localcluster.py points those at the manager on the host). The checksum database has no
# entry for sigs.k8s.io/kueue (its lookup answers 404), so that one module skips it (GONOSUMDB); its
# dependencies are still verified, and the module's hash is recorded in the wrapper's go.sum.
build_kueue() {
  local cfg="$CACHE/kueue-config-$KUEUE_VERSION" mod=sigs.k8s.io/kueue
  if have "$KUEUE_VERSION" kueue && [ -d "$cfg" ]; then log "kueue $KUEUE_VERSION cached"; else
    log "building kueue $KUEUE_VERSION"
    local dir="$WORK/kueue-$KUEUE_VERSION"
    wrapper "$dir" "$mod" "$KUEUE_VERSION" </dev/null
    (
      cd "$dir"
      export GONOSUMDB="$mod"
      go get "$mod/cmd/kueue@$KUEUE_VERSION"
      go build -ldflags "$LDFLAGS -X $mod/pkg/version.GitVersion=$KUEUE_VERSION" -o "$BIN/kueue-$KUEUE_VERSION" "$mod/cmd/kueue"
      src=$(go list -m -f '{{.Dir}}' "$mod")/config/components
      rm -rf "$cfg.tmp" && mkdir -p "$cfg.tmp/crd"
      cp "$src"/crd/bases/*.yaml "$cfg.tmp/crd/"
      # the conversion webhooks its kustomization enables (Kueue injects its CA into exactly those CRDs)
      mkdir "$cfg.tmp/crd-conversion"
      for f in $(sed -n 's#^- path: \(patches/webhook_in_[a-z]*\.yaml\)$#\1#p' "$src/crd/kustomization.yaml"); do
        cp "$src/crd/$f" "$cfg.tmp/crd-conversion/"
      done
      cp "$src/rbac/role.yaml" "$cfg.tmp/rbac-role.yaml"
      cp "$src/rbac/manager_secrets_role.yaml" "$cfg.tmp/rbac-secrets-role.yaml"
      cp "$src/webhook/manifests.yaml" "$cfg.tmp/webhooks.yaml"
      chmod -R u+w "$cfg.tmp" && rm -rf "$cfg" && mv "$cfg.tmp" "$cfg"
    )
  fi
  link kueue "$KUEUE_VERSION"
  ln -sfn "$cfg" "$BIN/current/kueue-config"
}

# The agent-sandbox controller (cmd/agent-sandbox-controller: the core Sandbox controller, and with --extensions
# the SandboxClaim, SandboxTemplate and SandboxWarmPool ones) and, from the module's k8s/, its four CRDs and the
# ClusterRoles of the core and extensions controllers. Only the controller's main package is built.
build_agent-sandbox() {
  local cfg="$CACHE/agent-sandbox-config-$AGENT_SANDBOX_VERSION" mod=sigs.k8s.io/agent-sandbox
  if have "$AGENT_SANDBOX_VERSION" agent-sandbox-controller && [ -d "$cfg" ]; then
    log "agent-sandbox $AGENT_SANDBOX_VERSION cached"
  else
    log "building agent-sandbox controller $AGENT_SANDBOX_VERSION"
    local dir="$WORK/agent-sandbox-$AGENT_SANDBOX_VERSION"
    wrapper "$dir" "$mod" "$AGENT_SANDBOX_VERSION" </dev/null
    (
      cd "$dir"
      go get "$mod/cmd/agent-sandbox-controller@$AGENT_SANDBOX_VERSION"
      go build -ldflags "$LDFLAGS -X $mod/internal/version.gitVersion=$AGENT_SANDBOX_VERSION" \
        -o "$BIN/agent-sandbox-controller-$AGENT_SANDBOX_VERSION" "$mod/cmd/agent-sandbox-controller"
      src=$(go list -m -f '{{.Dir}}' "$mod")/k8s
      rm -rf "$cfg.tmp" && mkdir -p "$cfg.tmp/crd"
      cp "$src"/crds/*.yaml "$cfg.tmp/crd/"
      cp "$src/rbac.generated.yaml" "$cfg.tmp/rbac-role.yaml"
      cp "$src/extensions-rbac.generated.yaml" "$cfg.tmp/rbac-extensions-role.yaml"
      chmod -R u+w "$cfg.tmp" && rm -rf "$cfg" && mv "$cfg.tmp" "$cfg"
    )
  fi
  link agent-sandbox-controller "$AGENT_SANDBOX_VERSION"
  ln -sfn "$cfg" "$BIN/current/agent-sandbox-config"
}

# Version stamp for binaries built from k8s.io/kubernetes (helm, kubectl and the node read it).
k8s_ldflags() {
  local minor=${K8S_VERSION#v1.}; minor=${minor%%.*} x=""
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    x+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
  done
  echo "$LDFLAGS$x"
}

# Real nodes: kubelet + kube-proxy of the control plane's version, and a CoreDNS with only the plugins a
# local cluster uses (kubernetes, cache, bind, errors, log), built as CoreDNS documents for custom builds.
build_node() {
  k8s_cmds kubelet kube-proxy
  if have "$COREDNS_VERSION" coredns; then log "coredns $COREDNS_VERSION cached"; else
    log "building coredns $COREDNS_VERSION"
    local cdir="$WORK/coredns-$COREDNS_VERSION"
    wrapper "$cdir" github.com/coredns/coredns "$COREDNS_VERSION" </dev/null
    cat >"$cdir/main.go" <<'GO'
// CoreDNS with the plugins the local cluster needs; the directive order follows CoreDNS's plugin.cfg.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
)

func init() {
	dnsserver.Directives = []string{"bind", "errors", "log", "cache", "kubernetes"}
}

func main() { coremain.Run() }
GO
    (cd "$cdir" && go mod tidy >/dev/null 2>&1 || go mod tidy; go build -ldflags "$LDFLAGS" -o "$BIN/coredns-$COREDNS_VERSION" .)
  fi
  link coredns "$COREDNS_VERSION"
}

# One build at a time (pytest fixtures and the demo may call this concurrently).
exec 9>"$CACHE/.lock"
flock 9
start=$(date +%s)
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(etcd kwok kuberay helm k8s)
for t in "${targets[@]}"; do "build_$t"; done
log "done in $(( $(date +%s) - start ))s"
echo "$BIN/current"
