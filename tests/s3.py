"""A real S3-compatible server for the tests: S3Proxy (``org.gaul:s3proxy``, Apache-2.0: the S3 API on jclouds; its
jar-with-dependencies fetched by Maven through ``hack/fetch-s3proxy.sh``, run with ``java -jar``) with the
``filesystem-nio2`` backend on a free port, data in a temporary directory.

``S3Server(root).start()`` starts one JVM with an S3 identity (``ACCESS_KEY``/``SECRET_KEY``; AWS signatures V2
and V4) from a properties file, the buckets named created as the backend's bucket directories beforehand, and
polls with a deadline until every bucket answers a signed list; ``env()`` is what a client needs (``AWS_*``);
``stop()`` ends it (SIGTERM, then SIGKILL) and reaps it. S3Proxy does not create buckets on upload: a missing
bucket is ``NoSuchBucket``, as on a real S3.
"""

from __future__ import annotations

import contextlib
import os
import re
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
BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def s3proxy_jar() -> str:
    """The cached S3Proxy jar (fetched by Maven on first use: seconds)."""
    return subprocess.run(["bash", str(REPO / "hack/fetch-s3proxy.sh")], check=True, capture_output=True, text=True,
                          timeout=900).stdout.strip().splitlines()[-1]


class S3Server:
    def __init__(self, root: Path, buckets: tuple[str, ...] = ("rlhf",), host: str = "127.0.0.1") -> None:
        """``host``: the address to listen on (loopback; the real-pod tier's bridge address, which pods reach)."""
        self.root = Path(root)
        self.buckets = buckets
        self.host = host
        self.proc: subprocess.Popen | None = None
        self.log = self.root / "s3proxy.log"
        self.port = 0
        self.endpoint = ""

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_REGION": "us-east-1"}

    def start(self, timeout: float = 90) -> Self:
        bad = [b for b in self.buckets if not BUCKET_NAME.fullmatch(b)]
        if bad:  # S3Proxy would not serve them: every request would answer NoSuchBucket
            raise ValueError(f"not S3 bucket names (3-63 of a-z 0-9 . -, a letter or digit at each end): {bad}")
        jar = s3proxy_jar()
        data = self.root / "data"
        for b in self.buckets:  # the filesystem backend's buckets are the directories under its base directory
            (data / b).mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.endpoint = f"http://{self.host}:{self.port}"
        config = self.root / "s3proxy.properties"
        # ignore-unknown-headers: S3Proxy answers 501 NotImplemented to a request with a header it does not know,
        # and a DeleteObjects request carries the x-amz-checksum-sha256 that S3 requires of it (the body is still
        # checked against the payload hash a V4 signature carries)
        config.write_text("\n".join([
            f"s3proxy.endpoint={self.endpoint}", "s3proxy.authorization=aws-v2-or-v4",
            f"s3proxy.identity={ACCESS_KEY}", f"s3proxy.credential={SECRET_KEY}",
            "s3proxy.ignore-unknown-headers=true",
            "jclouds.provider=filesystem-nio2", f"jclouds.filesystem.basedir={data}", ""]))
        # a bounded heap: objects live in the backend's files; a V4-signed request body is held in memory to check
        # its signature (at most 128 MiB each, S3Proxy's default; the runtime uploads in 8 MiB parts)
        args = ["java", "-Xmx1g", "-jar", jar, "--properties", str(config)]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=self.root,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"s3proxy exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            last = self._ready()
            if not last:
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"S3Proxy not ready after {timeout}s ({last}); log: {self.log.read_text()[-3000:]}")
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
        """'' once every bucket can be listed with the test identity (a signed request: the server is up and
        the bucket exists); else why not."""
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
