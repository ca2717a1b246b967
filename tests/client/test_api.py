"""The client against the real REST API (Django's live server on the test PostgreSQL database): login, a
resumable upload, a dataset, a project from an exported model, its checkpoint back into the module, and the
server's refusals as the researcher sees them."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from django.contrib.auth.models import User

from crowdtrain import ApiError, Client, load_into, login
from crowdtrain.cli import main
from crowdtrain.exporting import export
from crowdtrain.upload import Uploader, UploadState
from tests.api.conftest import approved_researcher
from tests.client.models import DigitNet
from tests.conftest import mnist_arrays, npz_bytes

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
PASSWORD = "ada-pass-123"  # approved_researcher's convention: f"{username}-pass-123"


@pytest.fixture
def ada(transactional_db: None) -> User:
    return approved_researcher("ada")


@pytest.fixture
def client(live_server: Any, ada: User) -> Client:
    credentials = login(live_server.url, "ada", PASSWORD)
    return Client(credentials.url, credentials.token)


@pytest.fixture
def digits_file(tmp_path: Path) -> Path:
    x, y = mnist_arrays(per_class=30)
    path = tmp_path / "digits.npz"
    path.write_bytes(npz_bytes(x=x[:240], y=y[:240], x_test=x[240:], y_test=y[240:]))
    return path


def test_login_gives_a_token_for_this_researcher(client: Client) -> None:
    assert client.me() == {"username": "ada", "is_researcher": True}


def test_a_wrong_password_shows_the_servers_detail(live_server: Any, ada: User) -> None:
    with pytest.raises(ApiError) as error:
        login(live_server.url, "ada", "wrong")
    assert error.value.status in (401, 403) and "Invalid username/password" in error.value.detail


def test_a_volunteer_gets_no_token_and_is_told_why(live_server: Any, transactional_db: None) -> None:
    User.objects.create_user("vol", password="vol-pass-123")
    with pytest.raises(ApiError) as error:
        login(live_server.url, "vol", "vol-pass-123")
    assert error.value.status == 403 and error.value.detail


def test_a_revoked_token_says_to_log_in_again(client: Client) -> None:
    client.logout()
    with pytest.raises(ApiError, match=r"HTTP 401 .*log in again"):
        client.me()


def upload_interrupted(client: Client, file: Path, state: UploadState, sent: int) -> str:
    """What a run killed after ``sent`` bytes leaves: a server-side upload and the local note of it."""
    upload = str(client.upload_create(filename=file.name, size=file.stat().st_size)["id"])
    client.upload_put(upload, 0, file.read_bytes()[:sent])
    state.put(UploadState.key(client.url, file), upload)
    return upload


def test_an_interrupted_upload_resumes_and_becomes_a_dataset(client: Client, digits_file: Path) -> None:
    state = UploadState(digits_file.parent / "uploads.json")
    upload = upload_interrupted(client, digits_file, state, sent=100_000)
    uploader = Uploader(client, state, chunk_bytes=64 * 1024, progress=False)
    assert uploader.upload(digits_file) == upload
    assert client.upload_status(upload)["offset"] == digits_file.stat().st_size
    dataset = client.create_dataset(name="digits", upload=upload, format="npz")
    assert (dataset["train_samples"], dataset["test_samples"], dataset["input_shape"]) == (
        240,
        60,
        [1, 28, 28],
    )
    assert [d["id"] for d in client.datasets()] == [dataset["id"]]


def test_a_bad_dataset_file_is_refused_with_the_reason(client: Client, tmp_path: Path) -> None:
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"this is not a zip archive")
    upload = Uploader(client, None, progress=False).upload(bad)
    with pytest.raises(ApiError) as error:
        client.create_dataset(name="bad", upload=upload, format="npz")
    assert error.value.status == 400 and error.value.detail
    assert client.datasets() == []


def test_a_pushed_model_comes_back_into_the_module(client: Client, digits_file: Path) -> None:
    upload = Uploader(client, None, progress=False).upload(digits_file)
    dataset = client.create_dataset(name="digits", upload=upload, format="npz")["id"]
    torch.manual_seed(1)
    model = DigitNet()
    exported = export(model, (1, 28, 28), name="DigitNet")
    project = client.create_project(
        name="Mine",
        dataset=dataset,
        graph=exported.graph,
        weights=exported.weights_bytes(),
        settings={"mode": "averaging"},
    )
    assert project["status"] == "draft" and project["settings"]["mode"] == "averaging"
    assert client.resolve_project("Mine") == project["id"]
    assert client.resolve_project(client.absolute(project["url"])) == project["id"]
    fresh = DigitNet()
    loaded = load_into(fresh, project=project["id"], version="latest", client=client)
    assert loaded.version == 0
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_no_best_version_before_an_evaluation_is_a_clear_404(client: Client, digits_file: Path) -> None:
    upload = Uploader(client, None, progress=False).upload(digits_file)
    dataset = client.create_dataset(name="digits", upload=upload, format="npz")["id"]
    project = client.create_project(name="Preset", dataset=dataset, preset="cnn")
    with pytest.raises(ApiError) as error:
        client.checkpoint(project["id"], "best")
    assert error.value.status == 404 and "best" in error.value.detail


def test_a_model_that_does_not_fit_the_dataset_is_refused_with_the_reason(
    client: Client, digits_file: Path
) -> None:
    upload = Uploader(client, None, progress=False).upload(digits_file)
    dataset = client.create_dataset(name="digits", upload=upload, format="npz")["id"]
    exported = export(DigitNet(), (1, 28, 28), name="DigitNet")
    exported.graph["inputs"][0]["shape"] = [-1, 1, 32, 32]
    with pytest.raises(ApiError) as error:
        client.create_project(
            name="Wrong", dataset=dataset, graph=exported.graph, weights=exported.weights_bytes()
        )
    assert error.value.status == 400
    assert client.projects(mine=True) == []


def test_cli_push_status_and_pull(
    client: Client,
    digits_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("CROWDTRAIN_URL", client.url)
    monkeypatch.setenv("CROWDTRAIN_TOKEN", str(client.session.headers["Authorization"]).split()[1])
    argv = [
        "--no-progress",
        "push",
        "tests.client.models:DigitNet",
        "--input-shape",
        "1,28,28",
        "--dataset",
        str(digits_file),
        "--name",
        "From the CLI",
        "--set",
        "learning_rate=0.05",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip()
    project = client.resolve_project("From the CLI")
    assert out == f"{client.url}/projects/{project}/"
    assert client.project(project)["settings"]["learning_rate"] == pytest.approx(0.05)
    assert main(["status"]) == 0
    assert "From the CLI" in capsys.readouterr().out
    weights = tmp_path / "w.safetensors"
    assert main(["pull", str(project), "--version", "latest", "-o", str(weights)]) == 0
    load_into(DigitNet(), file=weights)
    assert main(["push", *argv[2:4], "1,28,28", "--dataset-id", "999999", "--name", "x"]) == 1
    assert "No dataset of yours has this id" in capsys.readouterr().err


def test_login_command_stores_the_token(live_server: Any, ada: User, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(PASSWORD + "\n"))
    assert main(["login", live_server.url + "/", "--username", "ada", "--password-stdin"]) == 0
    assert Client.from_config().me()["username"] == "ada"
