"""A local S3-compatible server for tests and benches: moto's standalone server on loopback.

:func:`moto_s3` starts ``moto_server`` (the ``moto[server]`` test dependency) on 127.0.0.1 and a
free port, creates a bucket with boto3, and yields an :class:`S3` with the endpoint and the
environment a client needs: fake credentials in the standard AWS variables (Lance and pyarrow read
them), the endpoint, and ``AWS_ALLOW_HTTP`` (the server speaks plain HTTP). Nothing leaves the
machine. moto keeps objects in the server process's memory: stopping it drops them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

#: A fake secret, distinctive enough to grep for: it must never appear in anything written.
FAKE_SECRET = "eaglenest-FAKE-s3cret-7c1d9e"


@dataclasses.dataclass(frozen=True)
class S3:
    endpoint: str
    bucket: str
    env: dict[str, str]  # AWS_* variables a client process needs

    def uri(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix.strip('/')}"

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=self.env["AWS_REGION"],
                            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"])

    def objects(self, prefix: str = "") -> dict[str, int]:
        """key -> size of every object under ``prefix``."""
        out, token = {}, None
        c = self.client()
        while True:
            kw = {"Bucket": self.bucket, "Prefix": prefix, **({"ContinuationToken": token} if token else {})}
            page = c.list_objects_v2(**kw)
            out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
            if not page.get("IsTruncated"):
                return out
            token = page["NextContinuationToken"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _moto_server() -> list[str]:
    exe = Path(sys.executable).parent / "moto_server"
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("moto_server")
    if found:
        return [found]
    raise RuntimeError("moto_server not found: install the test extra (moto[server])")


@contextlib.contextmanager
def moto_s3(bucket: str = "eaglenest-test", *, log_path: str | None = None) -> Iterator[S3]:
    """A running moto S3 server with ``bucket`` created; stopped (its process ended) on exit."""
    port = _free_port()
    log = open(log_path or os.devnull, "w")
    proc = subprocess.Popen([*_moto_server(), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start on port {port}") from None
                time.sleep(0.1)
        env = {"AWS_ACCESS_KEY_ID": "eaglenest-test-key", "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
               "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true"}
        s3 = S3(endpoint=endpoint, bucket=bucket, env=env)
        s3.client().create_bucket(Bucket=bucket)
        yield s3
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
