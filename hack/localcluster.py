#!/usr/bin/env python3
"""A real Kubernetes control plane on this machine, for tests and the demo (no Docker, kind or k3s).

Processes: etcd, kube-apiserver (RBAC, audit log), kube-controller-manager, kube-scheduler, KWOK (fake GPU
nodes that run no containers but go Ready and mark scheduled pods Running) and the real KubeRay operator;
on request (``--kueue``, ``Cluster.install_kueue``) the real Kueue manager, also as a host process, and
(``--agent-sandbox``, ``Cluster.install_agent_sandbox``) the real agent-sandbox controller, one too.
With ``--real-nodes N`` also N real nodes (containerd + runc + CNI + kubelet, see ``realnodes.py``), cluster
DNS and Service routing; KubeRay then runs as a pod on a real node, as in real clusters, and the images of
``hack/build-images.sh`` are imported into every node.
Binaries come from ``hack/build-controlplane.sh`` (built from Go modules, cached by version).

    python3 hack/localcluster.py up   [--dir DIR] [--nodes 4] [--gpus-per-node 8] [--real-nodes 1] [--kueue]
                                      [--agent-sandbox]
    python3 hack/localcluster.py down [--dir DIR]

Only the standard library and the built binaries are used, so the same file serves pytest fixtures, the demo
and CI. Every process is started in its own session and stopped by its pid file.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import realnodes

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DIR = Path(os.environ.get("RLHF_CLUSTER_DIR", "/tmp/rlhf-cluster"))
#: Images every real node gets (hack/build-images.sh names).
REAL_NODE_IMAGES = ("pause", "kuberay", "operator", "runtime-cpu", "sandbox")
ADMIN_TOKEN = "rlhf-admin-token"  # test cluster on loopback only
GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"
KUEUE_NAMESPACE = "kueue-system"
KUEUE_SERVICE_ACCOUNT = "kueue-controller-manager"
KUEUE_WEBHOOK_SERVICE = "kueue-webhook-service"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
AGENT_SANDBOX_NAMESPACE = "agent-sandbox-system"
AGENT_SANDBOX_SERVICE_ACCOUNT = "agent-sandbox-controller"

AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
  - level: Request
    verbs: ["patch"]
    resources: [{group: "rlhf.dev"}]
  - level: Metadata
    verbs: ["create", "update", "patch", "delete", "deletecollection"]
  - level: Metadata
    resources: [{group: "rlhf.dev"}, {group: "ray.io"}]
  - level: None
"""


#: Where ``free_port`` picks: above Ray's default worker ports (10002-19999), below the kubelets'
#: (``realnodes.KUBELET_PORT_BASE`` + node), the NodePort range and the kernel's ephemeral range
#: (``ip_local_port_range``, 32768-60999 by default).
PORT_RANGE = (20000, realnodes.KUBELET_PORT_BASE)
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server started next. Not ``bind(0)``: the kernel hands out its ephemeral
    range, where a port closed here can be taken as the local port of any outgoing connection on the machine before
    the server binds it (the server then fails: "bind: address already in use"). The kernel never picks ports of
    ``PORT_RANGE`` by itself; each is handed out once per process, chosen at random (not from the seeded
    ``random``) so processes differ. Parallel test workers (pytest-xdist) pick from their own slices of it."""
    pick = random.SystemRandom()
    low, high = port_range()
    for _ in range(2000):
        port = pick.randrange(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free TCP port in {low}-{high - 1} on 127.0.0.1 after 2000 tries")


def port_range() -> tuple[int, int]:
    """``PORT_RANGE``, or in pytest-xdist worker ``gwI`` of N (and the processes it starts) the I-th of N equal
    slices of it: test workers that run side by side never hand out the same port."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count <= 1:
        return PORT_RANGE
    size = (PORT_RANGE[1] - PORT_RANGE[0]) // count
    low = PORT_RANGE[0] + int(worker[2:]) * size
    return low, low + size


def log(msg: str) -> None:
    print(f"[localcluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build(*targets: str) -> Path:
    out = subprocess.run(
        ["bash", str(REPO / "hack" / "build-controlplane.sh"), *targets], check=True, stdout=subprocess.PIPE, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


def build_images(*names: str) -> dict[str, dict[str, str]]:
    """Build (or find cached) the images of ``hack/build-images.sh``: name -> {ref, archive, format}."""
    out = subprocess.run(["bash", str(REPO / "hack" / "build-images.sh"), *names], check=True,
                         stdout=subprocess.PIPE, text=True)
    return json.loads(Path(out.stdout.strip().splitlines()[-1]).read_text())


@dataclass
class Cluster:
    dir: Path
    bin: Path
    #: image name -> {ref, archive}, filled by ``up`` when it starts real nodes
    images: dict[str, dict[str, str]] = field(default_factory=dict)
    real_nodes: int = 0
    #: the processes ``_start`` started, by name (``_wait`` fails at once when the one it waits for has exited)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict, repr=False)

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    @property
    def audit_log(self) -> Path:
        return self.dir / "audit.log"

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(
            [str(self.bin / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            check=False,
            text=True,
            capture_output=True,
        )
        if check and out.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
        return out

    # ---------------------------------------------------------------------------------------- processes
    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        logf = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child process
        proc = subprocess.Popen(
            argv, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}
        )
        (self.dir / f"{name}.pid").write_text(str(proc.pid))
        self.procs[name] = proc

    def stop(self) -> None:
        realnodes.stop_processes(self.dir)
        realnodes.down(self.dir)

    def _wait(self, what: str, ok, timeout: float = 120, process: str | None = None) -> None:
        """Poll ``ok`` until it is true, for at most ``timeout`` seconds; with ``process`` (a name given to
        ``_start``), fail as soon as that process has exited, with the end of its log, instead of at the deadline."""
        deadline = time.time() + timeout
        last: Exception | None = None
        while time.time() < deadline:
            proc = self.procs.get(process) if process else None
            if proc is not None and proc.poll() is not None:
                tail = (self.dir / f"{process}.log").read_text(errors="replace").strip().splitlines()[-5:]
                raise RuntimeError(f"{process} exited with {proc.returncode} before {what} was ready; the end of "
                                   f"{self.dir / f'{process}.log'}:\n" + "\n".join(tail))
            try:
                if ok():
                    return
            except Exception as e:  # noqa: BLE001 - keep polling until the deadline
                last = e
            time.sleep(0.5)
        raise TimeoutError(f"{what} not ready after {timeout}s (last error: {last}); logs in {self.dir}")

    # ------------------------------------------------------------------------------------------------ up
    def up(self, nodes: int = 4, gpus_per_node: int = 8, kuberay: bool = True, real_nodes: int = 0,
           kueue: bool = False, agent_sandbox: bool = False) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stop()
        self.real_nodes = real_nodes
        host = "127.0.0.1"
        if real_nodes:
            self.bin = build("node", "etcd", "kwok", "kuberay", "helm", "k8s")
            self.images = build_images(*REAL_NODE_IMAGES)
            realnodes.network_up(self.dir, self._nodes())
            host = realnodes.HOST_IP  # pods reach the apiserver (kubernetes.default) on the first bridge
        shutil.rmtree(self.dir / "etcd", ignore_errors=True)  # every `up` is a fresh cluster
        pki = self.dir / "pki"
        pki.mkdir(exist_ok=True)
        if not (pki / "sa.key").exists():
            subprocess.run(["openssl", "genrsa", "-out", str(pki / "sa.key"), "2048"], check=True, capture_output=True)
            subprocess.run(
                ["openssl", "rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub")],
                check=True,
                capture_output=True,
            )
        (self.dir / "tokens.csv").write_text(f'{ADMIN_TOKEN},admin,admin,"system:masters"\n')
        (self.dir / "audit-policy.yaml").write_text(AUDIT_POLICY)
        etcd_port, etcd_peer, api_port = free_port(), free_port(), free_port()
        b = self.bin
        self._start(
            "etcd",
            [
                str(b / "etcd"),
                "--data-dir", str(self.dir / "etcd"),
                "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                "--initial-cluster", f"default=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync", "--quota-backend-bytes", str(4 << 30),
            ],
        )
        self._wait("etcd", lambda: urllib.request.urlopen(f"http://127.0.0.1:{etcd_port}/health", timeout=2).status == 200,
                   process="etcd")
        self._start(
            "kube-apiserver",
            [
                str(b / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                f"--bind-address={host}", f"--advertise-address={host}", f"--secure-port={api_port}",
                f"--cert-dir={pki}", f"--token-auth-file={self.dir / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--service-cluster-ip-range={realnodes.SERVICE_CIDR}",
                "--allow-privileged=true",
                f"--audit-log-path={self.audit_log}", f"--audit-policy-file={self.dir / 'audit-policy.yaml'}",
                "--audit-log-format=json", "--audit-log-mode=blocking",
                "--audit-log-maxsize=100000",  # MB: never rotate (0 means lumberjack's 100 MB; 1,000 jobs write more)
                "--enable-priority-and-fairness=false",
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                # KWOK nodes have no node-lifecycle controller to lift the not-ready taint this plugin adds.
                "--disable-admission-plugins=TaintNodesByCondition",
            ],
        )
        server = f"https://{host}:{api_port}"
        self.kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "local", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
                    "users": [{"name": "admin", "user": {"token": ADMIN_TOKEN}}],
                    "contexts": [{"name": "local", "context": {"cluster": "local", "user": "admin"}}],
                    "current-context": "local",
                }
            )
        )
        ctx = ssl._create_unverified_context()

        def healthy() -> bool:
            req = urllib.request.Request(f"{server}/readyz", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
            return urllib.request.urlopen(req, timeout=3, context=ctx).status == 200

        self._wait("kube-apiserver", healthy, timeout=180, process="kube-apiserver")
        kc = f"--kubeconfig={self.kubeconfig}"
        self._start(
            "kube-controller-manager",
            [
                str(b / "kube-controller-manager"), kc, "--leader-elect=false", "--secure-port=0",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'apiserver.crt'}",
                "--use-service-account-credentials=false",
                "--controllers=*,-nodeipam,-nodelifecycle,-cloud-node-lifecycle,-service-lb-controller,-route",
                "--concurrent-gc-syncs=5",
            ],
        )
        self._start("kube-scheduler", [str(b / "kube-scheduler"), kc, "--leader-elect=false", "--secure-port=0"])
        self._start(
            "kwok",
            [
                str(b / "kwok"), kc, f"--config={b / 'kwok-stages.yaml'}",
                "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                "--cidr=10.0.0.1/16",
                "--node-ip=10.0.0.1",
                "--node-lease-duration-seconds=40",
            ],
        )
        self._wait("default service account", lambda: self.kubectl("get", "sa", "default").returncode == 0)
        self.add_nodes(nodes, gpus_per_node)
        if real_nodes:
            self.start_real_nodes()
        if kuberay:
            self.install_kuberay_pod() if real_nodes else self.install_kuberay()
        self.kubectl("apply", "--server-side", "-f", str(REPO / "crds" / "rlhf.dev_rlhfjobs.yaml"))
        self._wait(
            "RLHFJob CRD",
            lambda: self.kubectl("wait", "--for=condition=Established", "crd/rlhfjobs.rlhf.dev", "--timeout=5s").returncode == 0,
        )
        if kueue:
            self.install_kueue()
        if agent_sandbox:
            self.install_agent_sandbox()
        log(f"up: KUBECONFIG={self.kubeconfig}")

    def attach(self) -> bool:
        """Use a cluster with real nodes that is already up in ``dir`` (e.g. kept by a previous test run), with
        the current images imported into its nodes; False when there is none."""
        state = self.dir / "realnodes.json"
        if not state.exists() or self.kubectl("get", "--raw", "/readyz", check=False).returncode != 0:
            return False
        self.real_nodes = len(json.loads(state.read_text())["nodes"])
        self.images = build_images(*REAL_NODE_IMAGES)
        self._import_images(self._nodes())
        return True

    # ------------------------------------------------------------------------------------------ real nodes
    def _nodes(self) -> list[realnodes.Node]:
        return [realnodes.Node(i, self.dir / f"node-{i}") for i in range(self.real_nodes)]

    def start_real_nodes(self) -> None:
        """containerd + kubelet per node (images imported), then CoreDNS and kube-proxy on the host."""
        b, nodes = self.bin, self._nodes()
        (self.dir / "realnodes.json").write_text(json.dumps(
            {"nodes": [str(n.dir) for n in nodes], "kube_proxy": str((b / "kube-proxy").resolve())}))
        t0 = time.time()
        cache = Path(self.images["runtime-cpu"]["archive"]).parent.parent / "node-roots"
        seed = realnodes.seeded_root(cache, {k: self.images[k] for k in REAL_NODE_IMAGES})
        for n in nodes:
            realnodes.prepare(n, self.images["pause"]["ref"])
            realnodes.link_root(seed, n.dir / "containerd" / "root")
            self._start(f"containerd-{n.index}", ["containerd", "--config", str(n.dir / "containerd.toml")])
        log(f"node images from the seeded containerd root {seed.parent.name} in {time.time() - t0:.0f}s")
        self._import_images(nodes)  # finds them there
        for n in nodes:
            self._wait(f"the CRI of {n.name}'s containerd", lambda n=n: realnodes.cri_ready(n.socket), timeout=60)
            self._start(f"kubelet-{n.index}", [
                str(b / "kubelet"), f"--config={n.dir / 'kubelet.json'}", f"--kubeconfig={self.kubeconfig}",
                f"--hostname-override={n.name}", f"--node-ip={n.ip}", f"--root-dir={n.dir / 'kubelet'}",
                f"--cert-dir={n.dir / 'pki'}", f"--node-labels={realnodes.NODE_LABEL}=true",
            ])
        (self.dir / "Corefile").write_text(realnodes.corefile(self.kubeconfig))
        self._start("coredns", [str(b / "coredns"), "-conf", str(self.dir / "Corefile")])
        (self.dir / "kube-proxy.json").write_text(json.dumps(realnodes.kube_proxy_config(self.kubeconfig, nodes[0])))
        self._start("kube-proxy", [str(b / "kube-proxy"), f"--config={self.dir / 'kube-proxy.json'}"])

        def ready() -> bool:
            out = json.loads(self.kubectl("get", "nodes", "-l", f"{realnodes.NODE_LABEL}=true", "-o", "json").stdout)
            ok = [n for n in out["items"]
                  if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))]
            return len(ok) >= len(nodes)

        self._wait("real nodes Ready", ready, timeout=180)
        log(f"real nodes Ready: {', '.join(n.name for n in nodes)}")

    def _import_images(self, nodes: list[realnodes.Node]) -> None:
        """``self.images`` into every node's containerd (once it answers), the nodes side by side."""
        def load(n: realnodes.Node) -> None:
            self._wait(f"containerd of {n.name}", lambda: realnodes.sh(
                "ctr", "--address", str(n.socket), "version", check=False).returncode == 0, timeout=60)
            for img in self.images.values():
                realnodes.import_image(n, img["archive"], img["ref"])

        with ThreadPoolExecutor(len(nodes)) as pool:
            list(pool.map(load, nodes))

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run([str(self.bin / "helm"), "--kubeconfig", str(self.kubeconfig), *args],
                             check=False, capture_output=True, text=True)
        if check and out.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
        return out

    def install_operator_chart(self, release: str, namespace: str) -> None:
        """`helm install` of our chart with the locally built operator image, on a real node; waits until Ready."""
        repo, tag = self.images["operator"]["ref"].rsplit(":", 1)
        self.helm("install", release, str(REPO / "charts" / "rlhf-operator"), "-n", namespace, "--create-namespace",
                  "--set", f"image.repository={repo}", "--set", f"image.tag={tag}", "--set", "image.pullPolicy=Never",
                  "--set-string", f"nodeSelector.{realnodes.NODE_LABEL.replace('.', chr(92) + '.')}=true",
                  "--set", "resyncSeconds=5", "--set", "resources.requests.cpu=50m", "--wait", "--timeout", "5m")

    def install_kuberay_pod(self) -> None:
        """KubeRay's CRDs, its own ClusterRole, and the operator as a Deployment on a real node (it reaches
        the Ray dashboards through cluster DNS and Services, as in real clusters)."""
        b, ns = self.bin, "kuberay-system"
        self.kubectl("apply", "--server-side", "-f", str((b / "kuberay-crds").resolve()))
        self.kubectl("create", "namespace", ns, check=False)
        self.kubectl("apply", "-f", str((b / "kuberay-rbac.yaml").resolve()))
        labels = {"app.kubernetes.io/name": "kuberay", "app.kubernetes.io/component": "kuberay-operator"}
        objs = [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "kuberay-operator", "namespace": ns}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": "kuberay-operator"},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "kuberay-operator"},
             "subjects": [{"kind": "ServiceAccount", "name": "kuberay-operator", "namespace": ns}]},
            {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "kuberay-operator", "namespace": ns},
             "spec": {"replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": labels},
                      "template": {"metadata": {"labels": labels}, "spec": {
                          "serviceAccountName": "kuberay-operator",
                          "nodeSelector": {realnodes.NODE_LABEL: "true"},
                          "containers": [{
                              "name": "kuberay-operator", "image": self.images["kuberay"]["ref"],
                              "imagePullPolicy": "Never",
                              "args": ["--enable-leader-election=false"],
                              "resources": {"requests": {"cpu": "50m", "memory": "128Mi"},
                                            "limits": {"memory": "512Mi"}},
                              "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True,
                                                  "runAsUser": 65532, "readOnlyRootFilesystem": True},
                          }]}}}},
        ]
        self.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}))
        self._wait("KubeRay CRDs", lambda: self.kubectl(
            "wait", "--for=condition=Established", "crd/rayjobs.ray.io", "--timeout=5s", check=False).returncode == 0)
        self._wait("KubeRay pod Ready", lambda: self.kubectl(
            "wait", "-n", ns, "--for=condition=Available", "deployment/kuberay-operator", "--timeout=5s",
            check=False).returncode == 0, timeout=180)

    def install_kuberay(self) -> None:
        """KubeRay's own CRDs (from its Go module) and the real KubeRay operator."""
        b = self.bin
        self.kubectl("apply", "--server-side", "-f", str((b / "kuberay-crds").resolve()))
        self._wait(
            "KubeRay CRDs",
            lambda: self.kubectl("wait", "--for=condition=Established", "crd/rayjobs.ray.io", "--timeout=5s", check=False).returncode == 0,
        )
        self._start(
            "kuberay-operator",
            [str(b / "kuberay-operator"), "--enable-leader-election=false", "--metrics-addr=127.0.0.1:0",
             "--health-probe-bind-address=127.0.0.1:0"],
            env={"KUBECONFIG": str(self.kubeconfig)},
        )

    # --------------------------------------------------------------------------------------------- Kueue
    def _yaml_objects(self, path: Path) -> list[dict]:
        """The objects of a YAML file as JSON (kubectl parses it, so this module needs no YAML library)."""
        text = self.kubectl("create", "--dry-run=client", "--validate=false", "-o", "json", "-f", str(path)).stdout
        objs, pos, dec = [], 0, json.JSONDecoder()
        while pos < len(text.rstrip()):  # one JSON document per object, one after the other
            obj, end = dec.raw_decode(text, pos)
            objs.extend(obj["items"] if obj.get("kind") == "List" else [obj])
            pos = end + len(text[end:]) - len(text[end:].lstrip())
        return objs

    def install_kueue(self) -> None:
        """The real Kueue manager (``sigs.k8s.io/kueue``, ``build-controlplane.sh kueue``) as a host process, like
        KubeRay on KWOK clusters: its CRDs, ClusterRole and webhook configurations from the module's config/,
        its own ServiceAccount, the ``ray.io/rayjob`` integration only and ``manageJobsWithoutQueueName: false``
        (RayJobs without the queue label are left alone). Idempotent: a running Kueue is kept.

        Webhooks: Kueue's own certificate management (cert-controller, as in its release manifests) makes a CA
        and a serving certificate for ``kueue-webhook-service.kueue-system.svc`` and injects the CA into the
        webhook configurations and the CRDs' conversion webhooks. The apiserver resolves a webhook's Service
        itself: for an ``ExternalName`` Service it dials that name at the configured port, so the Service points
        at 127.0.0.1 and the webhook port is the manager's (a free port), while TLS is still verified against
        the Service's DNS name. (A ``url`` clientConfig with our own certificate would need Kueue's metrics
        certificate at the fixed path /etc/kueue/metrics/certs, which Kueue reads whenever its internal
        certificate management is off.) Only the webhooks of Kueue's own API and of RayJobs are installed, the
        RayJob ones with an objectSelector on the queue label, so jobs of other tests never wait on Kueue.
        """
        pidfile = self.dir / "kueue.pid"
        if pidfile.exists() and self._kueue_webhooks_answer():
            return
        cfg = (build("kueue") / "kueue-config").resolve()
        ns, svc = KUEUE_NAMESPACE, KUEUE_WEBHOOK_SERVICE
        webhook_port, health_port = free_port(), free_port()

        def service_ref(ref: dict) -> None:
            ref.update({"name": svc, "namespace": ns, "port": webhook_port})

        crds = self._yaml_objects(cfg / "crd")
        conversion = {o["metadata"]["name"]: o["spec"]["conversion"] for o in self._yaml_objects(cfg / "crd-conversion")
                      if "conversion" in o.get("spec", {})}
        for crd in crds:
            if crd["metadata"]["name"] in conversion:
                crd["spec"]["conversion"] = conversion[crd["metadata"]["name"]]
                service_ref(crd["spec"]["conversion"]["webhook"]["clientConfig"]["service"])
        self._apply_objects(crds)
        self._wait("Kueue CRDs", lambda: self.kubectl(
            "wait", "--for=condition=Established", "--timeout=5s", *(f"crd/{c['metadata']['name']}" for c in crds),
            check=False).returncode == 0)

        self.kubectl("create", "namespace", ns, check=False)
        role = self._yaml_objects(cfg / "rbac-role.yaml")[0]
        role["metadata"] = {"name": "kueue-manager-role"}
        secrets = self._yaml_objects(cfg / "rbac-secrets-role.yaml")[0]
        secrets["metadata"] = {"name": "kueue-manager-secrets-role", "namespace": ns}
        subject = [{"kind": "ServiceAccount", "name": KUEUE_SERVICE_ACCOUNT, "namespace": ns}]
        webhooks = []
        for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            whc = next(o for o in self._yaml_objects(cfg / "webhooks.yaml") if o["kind"] == kind)
            whc["metadata"] = {"name": f"kueue-{'mutating' if kind.startswith('M') else 'validating'}-webhook-configuration"}
            kept = []
            for wh in whc["webhooks"]:
                groups = {g for r in wh["rules"] for g in r["apiGroups"]}
                resources = {x for r in wh["rules"] for x in r["resources"]}
                if groups == {"kueue.x-k8s.io"} or (groups == {"ray.io"} and resources == {"rayjobs"}):
                    service_ref(wh["clientConfig"]["service"])
                    if "ray.io" in groups:
                        wh["objectSelector"] = {"matchExpressions": [{"key": KUEUE_QUEUE_LABEL, "operator": "Exists"}]}
                    kept.append(wh)
            whc["webhooks"] = kept
            webhooks.append(whc)
        self._apply_objects([
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": KUEUE_SERVICE_ACCOUNT, "namespace": ns}},
            role, secrets,
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": "kueue-manager-rolebinding"}, "subjects": subject,
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "kueue-manager-role"}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": "kueue-manager-secrets-rolebinding", "namespace": ns}, "subjects": subject,
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "kueue-manager-secrets-role"}},
            # The apiserver dials an ExternalName Service's name at the webhook's port: the manager on this host.
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": svc, "namespace": ns},
             "spec": {"type": "ExternalName", "externalName": "127.0.0.1",
                      "ports": [{"port": webhook_port, "protocol": "TCP"}]}},
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "kueue-webhook-server-cert", "namespace": ns}},
            *webhooks,
        ])
        certs = self.dir / "kueue-certs"
        shutil.rmtree(certs, ignore_errors=True)
        certs.mkdir()
        (self.dir / "kueue-config.json").write_text(json.dumps({
            "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
            "namespace": ns,
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(certs)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": True, "webhookServiceName": svc,
                                       "webhookSecretName": "kueue-webhook-server-cert"},
            "manageJobsWithoutQueueName": False,
            # The on-demand visibility API server needs in-cluster config for delegated authentication (and an
            # APIService): without it the manager exits a second after it started.
            "featureGates": {"VisibilityOnDemand": False},
            "integrations": {"frameworks": ["ray.io/rayjob"]},
        }))
        kubeconfig = self.token_kubeconfig(ns, KUEUE_SERVICE_ACCOUNT, self.dir / "kueue.kubeconfig", duration="24h")
        realnodes.stop_processes(self.dir, patterns=(pidfile.name,))
        self._start("kueue", [str(self.bin / "kueue"), f"--config={self.dir / 'kueue-config.json'}"],
                    env={"KUBECONFIG": str(kubeconfig)})
        self._wait("Kueue's webhook certificate", lambda: self._mount_kueue_certs(certs), timeout=120)
        self._wait("Kueue ready", lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{health_port}/readyz", timeout=2).status == 200, timeout=180)
        self._wait("Kueue webhooks answer the apiserver", self._kueue_webhooks_answer, timeout=120)
        log(f"Kueue up (webhooks on 127.0.0.1:{webhook_port})")

    def _mount_kueue_certs(self, certs: Path) -> bool:
        """What the kubelet does for Kueue's pod: its webhook Secret (written by Kueue's certificate rotator)
        as files in the webhook's certDir, which the rotator waits for."""
        out = self.kubectl("get", "secret", "-n", KUEUE_NAMESPACE, "kueue-webhook-server-cert", "-o", "json", check=False)
        data = json.loads(out.stdout).get("data") or {} if out.returncode == 0 else {}
        if not all(data.get(k) for k in ("tls.crt", "tls.key", "ca.crt")):
            return False
        for key, value in data.items():
            tmp = certs / f".{key}.tmp"
            tmp.write_bytes(base64.b64decode(value))
            tmp.chmod(0o600)
            tmp.replace(certs / key)
        return True

    def _kueue_webhooks_answer(self) -> bool:
        """A server-side dry run of a ResourceFlavor goes through Kueue's webhooks (sideEffects None)."""
        rf = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "rlhf-probe"}}
        return self.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(rf), check=False).returncode == 0

    # ------------------------------------------------------------------------------------------ agent-sandbox
    def install_agent_sandbox(self) -> None:
        """The real agent-sandbox controller (``sigs.k8s.io/agent-sandbox``, ``build-controlplane.sh agent-sandbox``)
        as a host process, like Kueue: its four CRDs (``agents.x-k8s.io`` Sandbox; ``extensions.agents.x-k8s.io``
        SandboxTemplate, SandboxClaim, SandboxWarmPool, all v1beta1) and the ClusterRoles of its core and extensions
        controllers from the module's k8s/, bound to its own ServiceAccount, whose token is all it acts with. Run
        with ``--extensions`` (claims, templates, warm pools) and without leader election; it has no webhooks.
        Sandbox pods land wherever their template lets the scheduler put them (real nodes: a ``nodeSelector`` on
        ``realnodes.NODE_LABEL``). Idempotent: a controller that answers its readiness probe is kept."""
        if self._agent_sandbox_ready():
            return
        cfg = (build("agent-sandbox") / "agent-sandbox-config").resolve()
        ns, sa = AGENT_SANDBOX_NAMESPACE, AGENT_SANDBOX_SERVICE_ACCOUNT
        crds = self._yaml_objects(cfg / "crd")
        self._apply_objects(crds)
        self._wait("agent-sandbox CRDs", lambda: self.kubectl(
            "wait", "--for=condition=Established", "--timeout=5s", *(f"crd/{c['metadata']['name']}" for c in crds),
            check=False).returncode == 0)
        self.kubectl("create", "namespace", ns, check=False)
        roles = self._yaml_objects(cfg / "rbac-role.yaml") + self._yaml_objects(cfg / "rbac-extensions-role.yaml")
        subject = [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]
        self._apply_objects([
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": ns}},
            *roles,
            *({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": r["metadata"]["name"]}, "subjects": subject,
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": r["metadata"]["name"]}}
              for r in roles),
        ])
        kubeconfig = self.token_kubeconfig(ns, sa, self.dir / "agent-sandbox.kubeconfig", duration="24h")
        health_port = free_port()
        realnodes.stop_processes(self.dir, patterns=("agent-sandbox.pid",))
        self._start("agent-sandbox", [
            str(self.bin / "agent-sandbox-controller"), "--extensions", "--leader-elect=false",
            "--metrics-bind-address=0", f"--health-probe-bind-address=127.0.0.1:{health_port}",
        ], env={"KUBECONFIG": str(kubeconfig)})
        (self.dir / "agent-sandbox.json").write_text(json.dumps({"health_port": health_port}))
        self._wait("agent-sandbox controller ready", self._agent_sandbox_ready, timeout=120, process="agent-sandbox")
        log(f"agent-sandbox controller up (readiness on 127.0.0.1:{health_port})")

    def _agent_sandbox_ready(self) -> bool:
        """The controller of this cluster answers its readiness probe."""
        state = self.dir / "agent-sandbox.json"
        if not state.exists() or not (self.dir / "agent-sandbox.pid").exists():
            return False
        port = json.loads(state.read_text())["health_port"]
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2).status == 200
        except OSError:
            return False

    def _apply_objects(self, objs: list[dict]) -> None:
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                     input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}))

    def token_kubeconfig(self, namespace: str, service_account: str, path: Path, duration: str = "2h") -> Path:
        """A kubeconfig that authenticates as a ServiceAccount (TokenRequest), to act with exactly its RBAC."""
        token = self.kubectl("create", "token", service_account, "-n", namespace, f"--duration={duration}").stdout.strip()
        cfg = json.loads(self.kubeconfig.read_text())
        cfg["users"] = [{"name": "admin", "user": {"token": token}}]
        path.write_text(json.dumps(cfg))
        return path

    def add_nodes(self, count: int, gpus: int, prefix: str = "gpu-node") -> None:
        items = []
        for i in range(count):
            items.append(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": f"{prefix}-{i}",
                        "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                        "labels": {
                            "type": "kwok",
                            "kubernetes.io/hostname": f"{prefix}-{i}",
                            "kubernetes.io/os": "linux",
                            "kubernetes.io/arch": "amd64",
                            "nvidia.com/gpu.product": GPU_PRODUCT,
                            "nvidia.com/gpu.count": str(gpus),
                        },
                    },
                    "status": {
                        "capacity": {"cpu": "128", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": str(gpus)},
                        "allocatable": {"cpu": "128", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": str(gpus)},
                    },
                }
            )
        self.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))

        def ready() -> bool:
            out = self.kubectl("get", "nodes", "-l", "type=kwok", "-o", "json").stdout
            nodes = json.loads(out)["items"]
            ok = [n for n in nodes if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))]
            return len(ok) >= count

        self._wait("KWOK nodes Ready", ready)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["up", "down", "build"])
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--real-nodes", type=int, default=0, help="real nodes (containerd + kubelet) beside KWOK's")
    p.add_argument("--kueue", action="store_true", help="also the real Kueue manager (ray.io/rayjob integration)")
    p.add_argument("--agent-sandbox", action="store_true",
                   help="also the real agent-sandbox controller (Sandbox, SandboxTemplate, SandboxClaim, SandboxWarmPool)")
    args = p.parse_args()
    binp = build() if args.action != "down" else Path("/nonexistent")
    c = Cluster(args.dir, binp)
    if args.action == "up":
        c.up(args.nodes, args.gpus_per_node, real_nodes=args.real_nodes, kueue=args.kueue,
             agent_sandbox=args.agent_sandbox)
        print(c.kubeconfig)
    elif args.action == "down":
        c.dir.mkdir(parents=True, exist_ok=True)
        c.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
