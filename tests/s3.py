"""A real S3-compatible server for the tests: SeaweedFS (``weed mini``, built from its Go module by
``hack/build-controlplane.sh seaweedfs``; Apache-2.0) on free loopback ports, data in a temporary directory.

``S3Server(root).start()`` starts one process (master, volume server, filer and S3 gateway: ``weed mini``) with an
S3 identity (``ACCESS_KEY``/``SECRET_KEY``) from an S3 config JSON, creates the buckets named, and polls with a deadline
until every bucket answers a signed list; ``env()`` is what a client needs (``AWS_*``); ``stop()`` ends it
(SIGTERM, then SIGKILL) and reaps it. Buckets are not created on upload (``-s3.autoCreateBucket=false``), so a
missing bucket is an error, as on a real S3.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, Self

from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[1]
ACCESS_KEY = "rlhf-test-access"
SECRET_KEY = "rlhf-test-secret-0123456789"


def weed_binary() -> str:
    """The cached ``weed`` (built on first use: minutes from an empty cache)."""
    out = subprocess.run(["bash", str(REPO / "hack/build-controlplane.sh"), "seaweedfs"], check=True,
                         capture_output=True, text=True, timeout=3600).stdout.strip().splitlines()[-1]
    return str(Path(out) / "weed")


def _free_ports(n: int) -> list[int]:
    return [free_port() for _ in range(n)]


class S3Server:
    def __init__(self, root: Path, buckets: tuple[str, ...] = ("rlhf",), host: str = "127.0.0.1") -> None:
        """``host``: the address to listen on (loopback; the real-pod tier's bridge address, which pods reach)."""
        self.root = Path(root)
        self.buckets = buckets
        self.host = host
        self.proc: subprocess.Popen | None = None
        self.log = self.root / "weed.log"
        self.port = 0
        self.endpoint = ""

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_REGION": "us-east-1"}

    def start(self, timeout: float = 90) -> Self:
        binary = weed_binary()
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "rlhf-test", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        # master, volume, filer and s3, each HTTP + gRPC (SeaweedFS's default gRPC port is HTTP + 10000: may clash)
        ports = _free_ports(8)
        self.port = ports[6]
        self.endpoint = f"http://{self.host}:{self.port}"
        args = [binary, "mini", f"-ip={self.host}", f"-ip.bind={self.host}", f"-dir={self.root / 'data'}",
                f"-master.port={ports[0]}", f"-master.port.grpc={ports[1]}",
                f"-volume.port={ports[2]}", f"-volume.port.grpc={ports[3]}",
                f"-filer.port={ports[4]}", f"-filer.port.grpc={ports[5]}",
                f"-s3.port={ports[6]}", f"-s3.port.grpc={ports[7]}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-s3.config={config}", "-s3.autoCreateBucket=false", f"-bucket={','.join(self.buckets)}",
                "-webdav=false", "-admin.ui=false", "-master.telemetry=false",
                f"-filer.localSocket={self.root / 'filer.sock'}", f"-s3.localSocket={self.root / 's3.sock'}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=self.root, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            last = self._ready()
            if not last:
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"SeaweedFS S3 not ready after {timeout}s ({last}); log: "
                                   f"{self.log.read_text()[-3000:]}")
            time.sleep(0.3)

    def store(self, bucket: str, **options: Any) -> Any:
        """An obstore ``S3Store`` of ``bucket`` with the test identity (``options`` added: client options, retries)."""
        from obstore.store import S3Store

        options.setdefault("client_options", {"allow_http": True})
        return S3Store(bucket, endpoint=self.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                       region="us-east-1", virtual_hosted_style_request=False, **options)

    @contextlib.contextmanager
    def environ(self) -> Iterator[dict[str, str]]:
        """This process as the server's client: ``env()`` in ``os.environ`` and the runtime's store cache
        (``storage._STORES``) cleared; both undone on exit."""
        from rlhf_runtime.infra import storage

        env = self.env()
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        storage._STORES.clear()
        try:
            yield env
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            storage._STORES.clear()

    def _ready(self) -> str:
        """'' once every bucket can be listed with the test identity (a signed request: the gateway, the filer
        behind it and the bucket are up); else why not."""
        import obstore

        for b in self.buckets:
            store = self.store(b, client_options={"allow_http": True, "timeout": "5s", "connect_timeout": "2s"},
                               retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=5),
                                             "backoff": {"init_backoff": timedelta(seconds=0.1),
                                                         "max_backoff": timedelta(seconds=1), "base": 2}})
            try:
                obstore.list_with_delimiter(store)
            except Exception as e:  # noqa: BLE001 - not ready yet: say why
                return f"bucket {b}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
