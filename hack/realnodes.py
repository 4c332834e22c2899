"""Real Kubernetes nodes on this machine, beside the KWOK GPU nodes: containers really run on them.

Per node: a containerd (Debian's 1.6, its own root, state, socket and cgroup parent) with runc and the
bridge + host-local CNI plugins, and a kubelet of the control plane's version (built from Go modules).
Shared by the nodes, on the host: CoreDNS (cluster DNS, ``*.svc.cluster.local``) and kube-proxy (iptables;
Service IPs, including ``kubernetes.default`` for in-cluster clients). Everything stays inside the machine:

* node ``i`` owns the bridge ``rlhf<i>`` with the pod subnet ``10.88.<i>.0/24`` and gateway ``10.88.<i>.1``
  (its node IP); pods reach each other and the host through the bridges; nothing is routed out (an iptables
  FORWARD rule drops pod traffic to anything outside the pod network, and nothing is masqueraded out);
* the apiserver and CoreDNS listen on ``10.88.0.1`` (``HOST_IP``), an address on the first bridge;
* kubelets run with ``cgroupRoot=/rlhf-node-<i>`` so two kubelets never see each other's pods.

What this machine needed (cgroups v1, a VM where some limits cannot be raised): ``failCgroupV1: false`` and
the cgroupfs driver; containerd's ``restrict_oom_score_adj`` (lowering oom_score_adj below 0 is refused);
a local pause image (no registry). The kubelet rewrites a few kernel sysctls: they are saved before the
nodes start and restored when they stop, like ``net.ipv4.ip_forward`` which the pod network needs.

Only the standard library: ``localcluster.py`` imports this in tests, the demo and CI.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

HOST_IP = "10.88.0.1"
POD_CIDR = "10.88.0.0/16"
SERVICE_CIDR = "10.96.0.0/16"
NODE_LABEL = "rlhf.dev/real-node"  # value "true": CPU work (operator, KubeRay, CPU jobs) goes there
CNI_BIN = "/usr/lib/cni"  # Debian's containernetworking-plugins
#: Sysctls the kubelet or the pod network change; saved before `up`, restored by `down`.
SYSCTLS = [
    "vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes", "net/ipv4/ip_forward",
    "net/bridge/bridge-nf-call-iptables",
]
#: The kubelets' ports: ``KUBELET_PORT_BASE + node index``, outside Ray's default worker ports (10002-19999, which
#: a local Ray on the host may take while a real-node cluster runs beside it) and the kernel's ephemeral range.
KUBELET_PORT_BASE = 29900
#: Which cluster dir owns the machine's real-node network now (one real-node cluster per machine).
OWNER = Path("/run/rlhf-operator/realnodes-owner")


def log(msg: str) -> None:
    import sys

    print(f"[realnodes {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sh(*argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run(list(argv), check=False, capture_output=True, text=True, input=input)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    return out


@dataclass(frozen=True)
class Node:
    index: int
    dir: Path

    @property
    def name(self) -> str:
        return f"real-node-{self.index}"

    @property
    def bridge(self) -> str:
        return f"rlhf{self.index}"

    @property
    def ip(self) -> str:
        return f"10.88.{self.index}.1"

    @property
    def subnet(self) -> str:
        return f"10.88.{self.index}.0/24"

    @property
    def socket(self) -> Path:
        return self.dir / "containerd.sock"

    @property
    def cgroup(self) -> str:
        return f"/rlhf-node-{self.index}"

    @property
    def kubelet_port(self) -> int:
        return KUBELET_PORT_BASE + self.index


# ------------------------------------------------------------------------------------------------ host network
def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name


def save_sysctls(dir: Path) -> None:
    saved = dir / "sysctls.json"
    if saved.exists():
        return
    values = {}
    for name in SYSCTLS:
        p = _sysctl_path(name)
        if p.exists():
            values[name] = p.read_text().strip()
    saved.write_text(json.dumps(values))


def restore_sysctls(dir: Path) -> None:
    saved = dir / "sysctls.json"
    if not saved.exists():
        return
    for name, value in json.loads(saved.read_text()).items():
        try:
            _sysctl_path(name).write_text(value)
        except OSError as e:
            log(f"could not restore {name}={value}: {e}")
    saved.unlink()


#: Pod traffic stays inside the machine: nothing from the pod network is forwarded anywhere but to it.
FORWARD_GUARD = ["FORWARD", "-s", POD_CIDR, "!", "-d", POD_CIDR, "-m", "comment", "--comment",
                 "rlhf-operator real nodes: pod traffic stays inside the machine", "-j", "DROP"]


def network_up(dir: Path, nodes: list[Node]) -> None:
    """Bridges with their gateway addresses (the apiserver binds to the first before any pod exists)."""
    if OWNER.exists():
        other = Path(OWNER.read_text().strip())
        if other != dir and other.exists():
            log(f"stopping the real nodes of {other} (one real-node cluster per machine)")
            stop_processes(other)
            down(other)
    OWNER.parent.mkdir(parents=True, exist_ok=True)
    OWNER.write_text(str(dir))
    save_sysctls(dir)
    _sysctl_path("net/ipv4/ip_forward").write_text("1")
    _sysctl_path("net/bridge/bridge-nf-call-iptables").write_text("1")
    if sh("iptables", "-C", *FORWARD_GUARD, check=False).returncode != 0:
        sh("iptables", "-I", *FORWARD_GUARD)
    for n in nodes:
        if sh("ip", "link", "show", n.bridge, check=False).returncode != 0:
            sh("ip", "link", "add", n.bridge, "type", "bridge")
        sh("ip", "addr", "replace", f"{n.ip}/24", "dev", n.bridge)
        sh("ip", "link", "set", n.bridge, "up")


# --------------------------------------------------------------------------------------------- configuration
def containerd_config(n: Node, pause_ref: str) -> str:
    d = n.dir
    return f"""version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"
oom_score = 0
[grpc]
  address = "{n.socket}"
[ttrpc]
  address = "{d}/containerd.ttrpc.sock"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause_ref}"
  restrict_oom_score_adj = true
  enable_selinux = false
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{d}/cni/net.d"
"""


def cni_config(n: Node) -> dict:
    return {
        "cniVersion": "0.4.0",
        "name": f"rlhf-{n.name}",
        "plugins": [
            {
                "type": "bridge",
                "bridge": n.bridge,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": n.subnet, "gateway": n.ip}]],
                    # a default route as on any cluster (vLLM, Ray and torch find their own address by
                    # asking the route to a public one); FORWARD_GUARD drops what would leave the machine
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(n.dir / "cni" / "ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(n: Node) -> dict:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # cgroups v1 here; v1.35+ refuses it unless told
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": n.cgroup,
        "containerRuntimeEndpoint": f"unix://{n.socket}",
        "address": n.ip,
        "port": n.kubelet_port,
        "readOnlyPort": 0,
        "healthzPort": 0,
        # the kubelet's port is on a bridge inside this machine; the apiserver reaches it for logs/exec
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDNS": [HOST_IP],
        "clusterDomain": "cluster.local",
        "resolvConf": str(n.dir / "resolv.conf"),
        "podLogsDir": str(n.dir / "pod-logs"),
        "failSwapOn": False,
        "protectKernelDefaults": False,
        "serializeImagePulls": False,
        "rotateCertificates": False,
        # images are imported, never pulled: never collect them; evict only when really short
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "maxPods": 110,
        "nodeStatusUpdateFrequency": "5s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "0s",
    }


def make_cgroup(path: str) -> None:
    """The kubelet's cgroupRoot must exist in every v1 hierarchy (cpuset needs its cpus/mems set)."""
    base = Path("/sys/fs/cgroup")
    for ctrl in sorted(p for p in base.iterdir() if p.is_dir() and (p / "cgroup.procs").exists()):
        d = ctrl / path.lstrip("/")
        d.mkdir(exist_ok=True)
        if (d / "cpuset.cpus").exists():
            for f in ("cpuset.cpus", "cpuset.mems"):
                if not (d / f).read_text().strip():
                    (d / f).write_text((ctrl / f).read_text())


def cgroup_pids(path: str) -> set[int]:
    pids: set[int] = set()
    d = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    if d.exists():
        for procs in d.rglob("cgroup.procs"):
            try:
                pids.update(int(x) for x in procs.read_text().split())
            except OSError:
                pass
    return pids


def remove_cgroup(path: str) -> None:
    base = Path("/sys/fs/cgroup")
    for ctrl in base.iterdir():
        d = ctrl / path.lstrip("/")
        if d.is_dir():
            for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                try:
                    sub.rmdir()
                except OSError:
                    pass
            try:
                d.rmdir()
            except OSError:
                pass


# ------------------------------------------------------------------------------------------------ lifecycle
def cri_ready(socket: Path) -> bool:
    """Whether the containerd at ``socket`` serves the CRI (``runtime.v1.RuntimeService/Version`` answers). Its gRPC
    answers ``ctr version`` before the CRI plugin has initialised; a kubelet started then checks the CRI once and
    exits ("validate CRI v1 runtime API ...: server is not initialized yet") and the node never registers.
    Without grpc (a Python with no Ray), ``ctr version`` only."""
    try:
        import grpc
    except ImportError:
        return sh("ctr", "--address", str(socket), "version", check=False).returncode == 0
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        version = channel.unary_unary("/runtime.v1.RuntimeService/Version")  # bytes in, bytes out
        try:
            version(b"", timeout=5)  # an empty VersionRequest
        except grpc.RpcError:
            return False
    return True


def prepare(n: Node, pause_ref: str) -> None:
    for sub in ("containerd", "cni/net.d", "cni/ipam", "kubelet", "pki", "pod-logs"):
        (n.dir / sub).mkdir(parents=True, exist_ok=True)
    (n.dir / "containerd.toml").write_text(containerd_config(n, pause_ref))
    (n.dir / "cni" / "net.d" / "10-rlhf.conflist").write_text(json.dumps(cni_config(n), indent=2))
    (n.dir / "kubelet.json").write_text(json.dumps(kubelet_config(n), indent=2))
    (n.dir / "resolv.conf").write_text(f"nameserver {HOST_IP}\n")
    make_cgroup(n.cgroup)


def import_image(n: Node, archive: str, ref: str, socket: Path | None = None) -> None:
    """Import an image archive of ``hack/build-images.sh`` into the node's containerd (CRI namespace k8s.io,
    unpacked for the overlayfs snapshotter), unless it is there already; ``socket``: another containerd's."""
    ctr = ["ctr", "--address", str(socket or n.socket), "-n", "k8s.io", "images"]
    if ref in sh(*ctr, "ls", "-q").stdout.split():
        return
    t0 = time.time()
    out = sh(*ctr, "import", archive, check=False)
    have = sh(*ctr, "ls", "-q").stdout.split()
    if ref not in have:
        raise RuntimeError(f"importing {archive} into {n.name} did not give {ref}: {out.stderr.strip()}; "
                           f"images: {have}")
    log(f"{n.name}: imported {ref} in {time.time() - t0:.0f}s")


def _seed_key(images: dict[str, dict[str, str]], version: str) -> str:
    refs = sorted(img["ref"] for img in images.values())  # tags are content hashes (build-images.sh)
    return hashlib.sha256(json.dumps([version, refs]).encode()).hexdigest()[:12]


def seeded_root(cache: Path, images: dict[str, dict[str, str]]) -> Path:
    """A containerd root with ``images`` imported and unpacked, made once per image set (and containerd
    version) under ``cache`` and kept there: every node of every later cluster starts from a hard-linked copy
    of it (``link_root``) instead of importing the images again (the runtime image is several GB: minutes a node).
    A new image set starts from a copy of the previous seed (``link_root``), drops the images no longer in the
    set and imports the new ones: a rebuilt image shares its unchanged layers (the runtime image's Python
    environment) with the old one, and containerd unpacks only the changed ones. Made by a containerd of its own
    (no CRI plugin) that is stopped before the root is used; one seed is kept, older ones are removed."""
    version = sh("containerd", "--version").stdout.strip()
    key = _seed_key(images, version)
    seed = cache / key
    if (seed / "complete").exists():
        return seed / "root"
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two clusters starting at once make it once
        if (seed / "complete").exists():
            return seed / "root"
        previous = _previous_seed(cache, version)
        for old in cache.iterdir():
            if old.is_dir() and old != previous:
                shutil.rmtree(old, ignore_errors=True)
        tmp = cache / f".{key}-{os.getpid()}"
        (tmp / "state").mkdir(parents=True)
        if previous is not None:
            link_root(previous / "root", tmp / "root")
        _fill_seed(tmp, images)
        shutil.rmtree(tmp / "state", ignore_errors=True)
        tmp.rename(seed)
        (seed / "complete").write_text(json.dumps({"version": version,
                                                   "refs": sorted(img["ref"] for img in images.values())}))
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        return seed / "root"


def _previous_seed(cache: Path, version: str) -> Path | None:
    """The complete seed under ``cache`` made by containerd ``version``, if any."""
    for old in sorted(cache.iterdir()):
        try:
            done = json.loads((old / "complete").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(done, dict) and done.get("version") == version:
            return old
    return None


def _fill_seed(tmp: Path, images: dict[str, dict[str, str]]) -> None:
    """Run a containerd of its own on the root under ``tmp``: remove the images not in ``images``, import the
    missing ones."""
    sock = Path(f"/tmp/rlhf-seed-{os.getpid()}.sock")  # unix socket paths are short
    (tmp / "containerd.toml").write_text(
        f'version = 2\nroot = "{tmp}/root"\nstate = "{tmp}/state"\n'
        f'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n[grpc]\n  address = "{sock}"\n'
        f'[ttrpc]\n  address = "{sock}.ttrpc"\n')
    with (tmp / "containerd.log").open("wb") as out:
        proc = subprocess.Popen(["containerd", "--config", str(tmp / "containerd.toml")], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 60
        while sh("ctr", "--address", str(sock), "version", check=False).returncode != 0:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"containerd for the image seed did not answer: {tmp / 'containerd.log'}")
            time.sleep(0.2)
        ctr = ["ctr", "--address", str(sock), "-n", "k8s.io", "images"]
        wanted = {img["ref"] for img in images.values()}
        gone = [ref for ref in sh(*ctr, "ls", "-q").stdout.split() if ref not in wanted]
        if gone:  # their layers that no wanted image shares go with them (containerd's garbage collection)
            sh(*ctr, "rm", "--sync", *gone)
        for img in images.values():
            import_image(Node(0, tmp), img["archive"], img["ref"], sock)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        sock.unlink(missing_ok=True)
        Path(f"{sock}.ttrpc").unlink(missing_ok=True)


def link_root(seed: Path, root: Path) -> None:
    """``root`` as a copy of the seeded containerd root ``seed``: files hard-linked (image layers and unpacked
    snapshots are never written once committed; a container writes to an overlay upper dir of its own), the
    bolt databases that containerd updates in place (``*.db``) copied."""
    root.parent.mkdir(parents=True, exist_ok=True)
    sh("cp", "-al", str(seed), str(root))
    for db in root.rglob("*.db"):
        db.unlink()
        shutil.copy2(seed / db.relative_to(root), db)


def corefile(kubeconfig: Path) -> str:
    return f""".:53 {{
    bind {HOST_IP}
    errors
    cache 5
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} local
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
}}
"""


def kube_proxy_config(kubeconfig: Path, node: Node) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables",
        "clusterCIDR": POD_CIDR,
        "hostnameOverride": node.name,
        "bindAddress": HOST_IP,
        "healthzBindAddress": "",
        "metricsBindAddress": "",
        # leave the machine's conntrack settings alone
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        "iptables": {"masqueradeAll": True, "localhostNodePorts": False},
    }


def _shim_pids(dir: Path) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"containerd-shim-runc-v2") and any(str(dir).encode() in c for c in cmd):
            pids.append(int(p.name))
    return pids


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def stop_processes(dir: Path, wait: float = 20.0, patterns: tuple[str, ...] = ("kubelet-*.pid", "*.pid")) -> None:
    """SIGKILL the process groups a cluster in ``dir`` started (by their pid files matching ``patterns``, by
    default kubelets first, so that nothing recreates the containers ``down`` then removes; a stopped cluster's
    state is thrown away, nothing needs a graceful exit), then wait up to ``wait`` seconds until they are gone
    (ports and files free)."""
    pids: list[int] = []
    for pattern in patterns:
        for pidfile in sorted(dir.glob(pattern)):
            try:
                pid = int(pidfile.read_text())
                os.killpg(pid, signal.SIGKILL)
                pids.append(pid)
            except (ProcessLookupError, ValueError, PermissionError):
                pass
            pidfile.unlink(missing_ok=True)
    deadline = time.time() + wait
    for pid in pids:
        while time.time() < deadline:
            _reap(pid)
            try:
                os.killpg(pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.05)


def _reap(pid: int) -> None:
    """Collect ``pid``'s exit status if this process started it: a killed child stays a zombie until its parent
    waits for it, and a zombie still counts as a member of its process group (``killpg(pid, 0)`` succeeds), so
    without this every stop waited its whole ``wait``."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def down(dir: Path) -> None:
    """Everything real nodes left behind once their processes are stopped: containers, shims, mounts,
    network namespaces, bridges, kube-proxy's rules, cgroups, sysctls. Safe to call twice."""
    state = dir / "realnodes.json"
    if not state.exists():
        return
    info = json.loads(state.read_text())
    nodes = [Node(i, Path(d)) for i, d in enumerate(info["nodes"])]
    for _ in range(3):  # containers, then their shims (which would restart nothing once containerd is gone)
        pids = set()
        for n in nodes:
            pids |= cgroup_pids(n.cgroup)
            pids.update(_shim_pids(n.dir))
        if not pids:
            break
        _kill(pids)
        time.sleep(0.5)
    mounts = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        mp = line.split()[1].replace("\\040", " ")
        if mp.startswith((str(dir) + "/", "/run/netns/cni-", "/var/run/netns/cni-")):
            mounts.append(mp)
    for mp in sorted(set(mounts), key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], check=False, capture_output=True)
    for ns in list(Path("/run/netns").glob("cni-*")) if Path("/run/netns").exists() else []:
        ns.unlink(missing_ok=True)
    kp = info.get("kube_proxy")
    if kp and Path(kp).exists():
        subprocess.run([kp, "--cleanup"], check=False, capture_output=True)
    while sh("iptables", "-D", *FORWARD_GUARD, check=False).returncode == 0:
        pass
    for n in nodes:
        subprocess.run(["ip", "link", "del", n.bridge], check=False, capture_output=True)
        remove_cgroup(n.cgroup)
    restore_sysctls(dir)
    state.unlink()
    if OWNER.exists() and OWNER.read_text().strip() == str(dir):
        OWNER.unlink()
    for n in nodes:  # containerd's snapshots are large (GBs): a stopped cluster keeps none; removed in the
        # background (renamed first, so nothing can use them), the caller does not wait for the disk
        snapshots = n.dir / "containerd"
        if snapshots.exists():
            trash = n.dir / f".containerd-removed-{os.getpid()}-{time.monotonic_ns()}"
            snapshots.rename(trash)
            subprocess.Popen(["rm", "-rf", str(trash)], start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
