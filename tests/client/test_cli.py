"""The `crowdtrain` command's parsing and its errors (no server: a closed port stands for a down one)."""

from __future__ import annotations

import io
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from crowdtrain.cli import main, parser
from crowdtrain.config import config_path

PUSH = ["push", "tests.client.models:DigitNet", "--input-shape", "1,28,28", "--name", "n"]


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_push_parses_every_option() -> None:
    args = parser().parse_args(
        [
            *PUSH,
            "--dataset",
            "d.zip",
            "--channels",
            "3",
            "--height",
            "32",
            "--width",
            "32",
            "--mode",
            "averaging",
            "--set",
            "learning_rate=0.05",
            "--set",
            "target_value=0.9",
            "--start",
            "--kwargs",
            '{"width": 4}',
        ]
    )
    assert args.input_shape == (1, 28, 28) and args.dataset == Path("d.zip") and args.start
    assert args.settings == [("learning_rate", "0.05"), ("target_value", "0.9")]
    assert (args.channels, args.height, args.width, args.mode) == (3, 32, 32, "averaging")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "one of the arguments --dataset --dataset-id is required"),
        (["--dataset", "a.npz", "--dataset-id", "3"], "not allowed with argument"),
        (["--dataset-id", "3", "--set", "lr"], "expected key=value"),
        (["--dataset-id", "3", "--input-shape", "1,x"], "integers like 1,28,28"),
        (["--dataset-id", "3", "--input-shape", "0,28"], "between 1 and"),
        (["--dataset-id", "3", "--mode", "fast"], "invalid choice: 'fast'"),
    ],
)
def test_bad_push_arguments_are_refused_by_name(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parser().parse_args([*PUSH, *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_watch_interval_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["watch", "7", "--interval", "0"])
    assert "expected a positive number" in capsys.readouterr().err


def test_push_without_login_says_how(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PUSH, "--dataset-id", "3"]) == 1
    assert "crowdtrain: error: no server: run `crowdtrain login URL`" in capsys.readouterr().err


def test_push_of_a_class_that_is_not_there_fails_before_any_network(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        main(["push", "tests.client.models:Nope", "--input-shape", "4", "--name", "n", "--dataset-id", "1"])
        == 1
    )
    assert "'Nope' in 'tests.client.models' is not a torch.nn.Module subclass" in capsys.readouterr().err


def test_push_of_a_class_that_needs_arguments_names_them(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "push",
        "tests.client.models:NeedsArgument",
        "--input-shape",
        "4",
        "--name",
        "n",
        "--dataset-id",
        "1",
    ]
    assert main(argv) == 1
    assert "NeedsArgument(**{}) failed: TypeError" in capsys.readouterr().err
    assert main([*argv, "--kwargs", "[1]"]) == 1
    assert "--kwargs must be a JSON object" in capsys.readouterr().err


def test_push_of_a_module_that_cannot_export_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "push",
        "tests.client.models:DigitNet",
        "--input-shape",
        "3,28,28",
        "--name",
        "n",
        "--dataset-id",
        "1",
    ]
    assert main(argv) == 1
    assert "cannot export DigitNet" in capsys.readouterr().err


def test_login_to_a_server_that_is_down(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("pw\n"))
    url = closed_port_url()
    assert main(["login", url, "--username", "ada", "--password-stdin"]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach {url} (POST /api/auth/login/): connection failed" in err
    assert not config_path().exists()  # nothing stored on failure


def test_login_refuses_a_url_that_is_not_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["login", "ftp://x", "--username", "a", "--password-stdin"]) == 1
    assert "not a server URL: 'ftp://x'" in capsys.readouterr().err


def test_pull_refuses_a_version_that_is_not_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("CROWDTRAIN_URL", closed_port_url())
    monkeypatch.setenv("CROWDTRAIN_TOKEN", "t")
    assert main(["pull", "7", "--version", "newest", "-o", str(tmp_path / "w.safetensors")]) == 1
    assert "a version is 'best', 'latest' or a number; got 'newest'" in capsys.readouterr().err
    assert not (tmp_path / "w.safetensors").exists()


def test_the_console_script_runs() -> None:
    script = Path(sys.executable).with_name("crowdtrain")
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True)
    for command in ("login", "push", "status", "watch", "pull"):
        assert command in result.stdout


def test_config_written_by_login_is_private(monkeypatch: pytest.MonkeyPatch) -> None:
    """login's storage path (the HTTP exchange itself is in test_api.py, against the real API)."""
    from crowdtrain.config import Credentials, save_credentials

    path = save_credentials(Credentials("http://h", "t"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
