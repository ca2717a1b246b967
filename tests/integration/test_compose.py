"""docker-compose.yml scales: `--scale web=N worker=N validator=N` must not collide on a host port or a
container name, nginx must be the one entry point and reach every web replica, migrations must run once
before the replicas, and every role compose starts must exist in the image's entry point. (`docker compose
config` needs the Compose plugin, which this machine lacks: the file is read with PyYAML instead.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
NGINX = ROOT / "platform" / "nginx.conf"
ENTRYPOINT = ROOT / "platform" / "entrypoint.sh"
ENV_EXAMPLE = ROOT / "platform" / "env.example"
SCALED = ("web", "sockets", "worker", "validator")
SINGLETONS = ("db", "redis", "release", "baseline", "beat", "nginx")
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
