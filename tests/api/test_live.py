"""The API against the real server (daphne on PostgreSQL and Redis, as in production): schemathesis fuzzes
every operation from the served schema, as an approved researcher and anonymously, and finds no 5xx, no
response outside the schema and no auth bypass; an upload cut off mid-chunk by a dropped connection resumes.

Two of schemathesis's checks are left out: positive_data_acceptance and negative_data_rejection. The API
refuses schema-valid requests on rules a schema cannot state (a dataset id must be one of yours, a preset
or a graph but not both, an upload must be complete) and, like DRF everywhere, coerces `0` into the string
"0"; neither is a failure of the server."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devstack.stack import PYTHON, ROOT, Stack
from tests.conftest import mnist_arrays, npz_bytes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SETUP = """
from tests.api.conftest import approved_researcher
from accounts.services import api_token_create
from projects.datasets import dataset_create_from_npz
from projects.services import project_create
from tests.conftest import mnist_arrays, npz_bytes
user = approved_researcher("fuzzer")
x, y = mnist_arrays(per_class=10)
dataset = dataset_create_from_npz(owner=user, name="fuzz digits", data=npz_bytes(x=x, y=y))
project = project_create(owner=user, name="fuzz draft", dataset=dataset, preset="mlp")
uploader = approved_researcher("uploader")
print("SETUP", api_token_create(user=user)[1], dataset.pk, project.pk, api_token_create(user=uploader)[1])
"""


class ApiStack(Stack):
    """daphne alone: every API request is answered in the request (Celery only trains)."""

    def spawn_processes(self) -> None:
        self._spawn("web", "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port), "config.asgi:application")
        self._wait_for_http()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with ApiStack(
        var_dir=tmp_path_factory.mktemp("api-stack"), database="crowdtrain_e2e_h4", redis_db=13
    ) as running:
        yield running


@pytest.fixture(scope="module")
def fuzzer(stack: Stack) -> dict[str, Any]:
    """An approved researcher's token, their dataset and their draft project, in the stack's database; and a
    second researcher's token, for uploads (the fuzzer's runs leave unfinished uploads behind)."""
    done = subprocess.run(
        [PYTHON, "manage.py", "shell", "-v", "0", "-c", SETUP],
        cwd=ROOT,
        env=stack.env(),
        capture_output=True,
        text=True,
        check=True,
    )
    line = next(line for line in done.stdout.splitlines() if line.startswith("SETUP"))
    _, token, dataset, project, uploader = line.split()
    return {"token": token, "dataset": int(dataset), "project": int(project), "uploader": uploader}


def schemathesis(stack: Stack, tmp_path: Path, name: str, *args: str) -> dict[str, Any]:
    """One bounded run: no failure and no error, else its output says which request did what."""
    report = tmp_path / f"{name}.json"
    command = [
        str(Path(sys.executable).with_name("schemathesis")), "run", f"{stack.url}/api/schema/",
        "--checks", "all", "--exclude-checks", "positive_data_acceptance,negative_data_rejection",
        "--seed", "12", "--request-timeout", "30", "--no-shrink",
        "--report", "json", "--report-json-path", str(report), "--wait-for-schema", "30", *args,
    ]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-20000:] + done.stderr[-5000:]
    result = dict(json.loads(report.read_text()))
    print(
        name,
        result["operations"]["tested"],
        "operations",
        result["test_cases"],
        f"{result['running_time']:.0f} s",
    )
    assert result["failures"] == [] and result["errors"] == [] and result["operations"]["tested"] >= 19
    return result


def test_schemathesis_finds_nothing_as_a_researcher_on_their_own_objects(
    stack: Stack, fuzzer: dict[str, Any], tmp_path: Path
) -> None:
    config = tmp_path / "schemathesis.toml"  # read from the run's working directory
    config.write_text(
        f'[parameters]\n"path.project_id" = {fuzzer["project"]}\n"path.dataset_id" = {fuzzer["dataset"]}\n'
    )
    schemathesis(
        stack, tmp_path, "own", "--max-examples", "5", "-H", f"Authorization: Token {fuzzer['token']}",
        "--exclude-path", "/api/auth/logout/",  # it would revoke the token the run uses
    )  # fmt: skip


def test_schemathesis_finds_nothing_as_a_researcher_on_anything(
    stack: Stack, fuzzer: dict[str, Any], tmp_path: Path
) -> None:
    """Any id: other users' projects (the demo's), drafts and datasets: refused, never served or changed."""
    token = fuzzer["token"]
    schemathesis(
        stack, tmp_path, "any", "--max-examples", "3", "--phases", "coverage,fuzzing",
        "-H", f"Authorization: Token {token}", "--exclude-path", "/api/auth/logout/",
    )  # fmt: skip


def test_schemathesis_finds_nothing_anonymously(stack: Stack, fuzzer: dict[str, Any], tmp_path: Path) -> None:
    schemathesis(stack, tmp_path, "anonymous", "--max-examples", "3", "--phases", "coverage,fuzzing")


def http(stack: Stack, method: str, path: str, token: str, body: bytes = b"", **headers: str) -> Any:
    request = urllib.request.Request(stack.url + path, data=body or None, method=method)
    request.add_header("Authorization", f"Token {token}")
    for name, value in headers.items():
        request.add_header(name.replace("_", "-"), value)
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_an_upload_cut_off_mid_chunk_resumes_from_the_servers_offset(
    stack: Stack, fuzzer: dict[str, Any]
) -> None:
    token = fuzzer["uploader"]
    x, y = mnist_arrays(per_class=20)
    data = npz_bytes(x=x, y=y)
    body = json.dumps({"filename": "digits.npz", "size": len(data)}).encode()
    upload = http(stack, "POST", "/api/uploads/", token, body, Content_Type="application/json")["id"]
    half = len(data) // 2
    http(
        stack,
        "PUT",
        f"/api/uploads/{upload}/",
        token,
        data[:half],
        Upload_Offset="0",
        Content_Type="application/octet-stream",
    )

    # The second chunk's connection drops after 1000 of its bytes.
    with socket.create_connection(("127.0.0.1", stack.port)) as sock:
        head = (
            f"PUT /api/uploads/{upload}/ HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Token {token}\r\n"
            f"Upload-Offset: {half}\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: {len(data) - half}\r\n\r\n"
        )
        sock.sendall(head.encode() + data[half : half + 1000])
    assert http(stack, "GET", f"/api/uploads/{upload}/", token)["offset"] == half  # none of it counted

    done = http(
        stack,
        "PUT",
        f"/api/uploads/{upload}/",
        token,
        data[half:],
        Upload_Offset=str(half),
        Content_Type="application/octet-stream",
    )
    assert done["offset"] == len(data)
    form = json.dumps({"name": "resumed live", "upload": upload}).encode()
    dataset = http(stack, "POST", "/api/datasets/", token, form, Content_Type="application/json")
    assert dataset["train_samples"] == 180 and dataset["input_shape"] == [1, 28, 28]
