"""A real S3-compatible HTTP server on this machine, for blobs in a bucket (projects/blob_store.py): moto's
server mode (`moto[server]`, a dev dependency) in a process of its own, as MinIO would be in production."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import boto3

from config import supervisor
from devstack.stack import free_port

ACCESS_KEY, SECRET_KEY, REGION = "crowdtrain-local-key", "crowdtrain-local-secret", "us-east-1"


@dataclass
class S3Server:
    log_path: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        alive = lambda: self.process is not None and self.process.poll() is None  # noqa: E731
        if not supervisor.wait_for_port("127.0.0.1", self.port, 60, alive):
            self.__exit__()
            raise RuntimeError(f"the S3 server did not start; see {self.log_path}")
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)

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
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        }

    def storage_option(self, bucket: str) -> dict[str, Any]:
        """STORAGES["blobs"] as config/settings.py builds it from env(bucket), for override_settings."""
        options = {"bucket_name": bucket, "location": "blobs", "endpoint_url": self.endpoint}
        credentials = {"access_key": ACCESS_KEY, "secret_key": SECRET_KEY, "region_name": REGION}
        return {
            "BACKEND": "storages.backends.s3.S3Storage",
            "OPTIONS": {**options, **credentials, "file_overwrite": True, "max_memory_size": 8 * 2**20},
        }
