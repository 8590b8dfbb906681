"""A local S3-compatible server for the object-store pool tests and benchmarks: moto's server mode (a
protocol-level S3 emulator from PyPI; no real S3 server installs from the registries here),
on 127.0.0.1, with one bucket. It honours S3's conditional writes (If-None-Match), which Lance's
commits rely on (README: "A pool on object storage")."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._common import stop
from streamrl.connectors.ports import PortTaken, says_address_in_use, start_on_free_port
from streamrl.connectors.sglang.router import _die_with_parent

BUCKET = "streamrl-test"
# Credentials travel in the environment (a recipe refuses them); moto accepts any.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test-key", "AWS_SECRET_ACCESS_KEY": "test-secret", "AWS_REGION": "us-east-1"}


@dataclass
class S3Server:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    env: dict[str, str] = field(default_factory=lambda: dict(CREDENTIALS))

    @property
    def storage_options(self) -> dict[str, str]:
        """What a recipe's pool.storage_options holds for this server (no credentials)."""
        return {"aws_endpoint": self.url, "allow_http": "true"}

    def new_uri(self, name: str = "pool") -> str:
        return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}/{name}"

    def objects(self, prefix: str) -> list[dict[str, Any]]:
        """The objects under `prefix` (what the pool wrote there): S3's listing entries (Key, Size, ...)."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return [o for page in pages for o in page.get("Contents", [])]

    def client(self) -> Any:
        import boto3  # 0.16 s of botocore; only the S3 runs need it, not every pool benchmark importing this

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                            region_name=CREDENTIALS["AWS_REGION"])

    def stop(self) -> None:
        stop(self.proc)


def start_s3(log: Path) -> S3Server:
    def start(port: int) -> S3Server:
        with open(log, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                text = log.read_text(errors="replace")
                if says_address_in_use(text):
                    raise PortTaken(text[-300:])
                raise RuntimeError(f"moto server exited with {proc.returncode}:\n{text[-2000:]}")
            try:
                urllib.request.urlopen(url + "/moto-api/", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"moto server did not answer on {url} in 60 s") from None
                time.sleep(0.1)
        server = S3Server(url, proc, log)
        server.client().create_bucket(Bucket=BUCKET)
        return server

    return start_on_free_port(start)
