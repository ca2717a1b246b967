"""The `crowdtrain` command: login, push, status, watch, pull (``crowdtrain COMMAND --help``)."""

from __future__ import annotations

import argparse
import getpass
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._version import __version__
from .client import Client, checkpoint_version, login, normalise_url
from .config import config_path, forget_credentials, load_credentials, save_credentials
from .errors import CrowdtrainError, ServerUnreachable
from .exporting import (
    INPUT_DTYPES,
    LOSSES,
    Exported,
    export,
    import_class,
    instantiate,
    parse_kwargs,
    parse_shape,
)
from .upload import Uploader, UploadState
from .watch import render, status_table, target_reached

FORMATS = {".npz": "npz", ".zip": "images", ".txt": "text"}
SETTING = re.compile(r"^([a-z_]{1,40})=(.{0,200})$")
CLEAR = "\x1b[H\x1b[J"


def setting(text: str) -> tuple[str, str]:
    match = SETTING.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected key=value (e.g. learning_rate=0.05); got {text!r}")
    return match.group(1), match.group(2)


def shape(text: str) -> tuple[int, ...]:
    try:
        return parse_shape(text)
    except CrowdtrainError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number; got {text!r}")
    return value


def add_login(commands: Any) -> None:
    p = commands.add_parser("login", help="get an API token for a server and store it")
    p.add_argument("url", help="the site, e.g. https://crowdtrain.example.org")
    p.add_argument("--username", "-u", help="asked for when not given")
    p.add_argument("--password-stdin", action="store_true", help="read the password from standard input")
    p.set_defaults(run=run_login)
    commands.add_parser("logout", help="revoke the stored token").set_defaults(run=run_logout)


def add_push(commands: Any) -> None:
    p = commands.add_parser("push", help="export a model, upload its dataset and create a project")
    p.add_argument("model", help="module:Class, e.g. mypkg.models:Net (importable from here)")
    p.add_argument("--input-shape", required=True, type=shape, help="one sample, e.g. 1,28,28")
    p.add_argument("--input-dtype", default="float32", choices=INPUT_DTYPES)
    p.add_argument("--loss", default="cross_entropy", choices=LOSSES)
    p.add_argument("--kwargs", help='JSON arguments for the class, e.g. {"hidden": 128}')
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--dataset", type=Path, help="a file to upload: .npz, .zip of images or .txt")
    data.add_argument("--dataset-id", type=int, help="one of your datasets already on the server")
    p.add_argument("--dataset-format", choices=sorted(set(FORMATS.values())), help="default: by suffix")
    p.add_argument("--dataset-name", help="default: the file's name")
    for option in ("--channels", "--height", "--width", "--block-size"):
        p.add_argument(option, type=int, help="images: channels/height/width; text: block size")
    p.add_argument("--vocabulary", choices=["chars", "bytes"], help="text datasets")
    p.add_argument("--name", required=True, help="the project's name")
    p.add_argument("--description", default="")
    p.add_argument("--mode", choices=["sync_sgd", "averaging", "async_sgd"])
    p.add_argument(
        "--set",
        dest="settings",
        type=setting,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any training setting, e.g. --set learning_rate=0.05 --set target_value=0.95",
    )
    p.add_argument("--start", action="store_true", help="start training at once")
    p.set_defaults(run=run_push)


def add_follow(commands: Any) -> None:
    commands.add_parser("status", help="your projects").set_defaults(run=run_status)
    p = commands.add_parser("watch", help="follow a project's training live")
    p.add_argument("project", help="id, project page URL or name")
    p.add_argument("--interval", type=positive, default=5.0, help="seconds between refreshes (default 5)")
    p.add_argument("--until-target", action="store_true", help="exit once the target metric is reached")
    p.add_argument("--timeout", type=positive, help="give up (exit 2) after this many seconds")
    p.set_defaults(run=run_watch)
    p = commands.add_parser("pull", help="download a version's weights (safetensors)")
    p.add_argument("project", help="id, project page URL or name")
    p.add_argument("--version", default="best", help="best (default), latest or a version number")
    p.add_argument("-o", "--output", type=Path, required=True, help="e.g. weights.safetensors")
    p.set_defaults(run=run_pull)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="crowdtrain",
        description="Train PyTorch models on Crowdtrain's volunteers. Server and token come from "
        f"`crowdtrain login` ({config_path()}) or CROWDTRAIN_URL and CROWDTRAIN_TOKEN.",
    )
    p.add_argument("--version", action="version", version=f"crowdtrain {__version__}")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (add_login, add_push, add_follow):
        add(commands)
    return p


# --- commands -------------------------------------------------------------------------------------


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_login(args: argparse.Namespace) -> int:
    normalise_url(args.url)  # a typo is refused before the password is asked for
    username = args.username or input("Username: ").strip()
    password = sys.stdin.readline().rstrip("\n") if args.password_stdin else getpass.getpass("Password: ")
    credentials = login(args.url, username, password)
    path = save_credentials(credentials)
    say(f"Logged in to {credentials.url} as {username}; token stored in {path}")
    return 0


def run_logout(args: argparse.Namespace) -> int:
    credentials = load_credentials()
    try:
        Client(credentials.url, credentials.token).logout()
    finally:
        forget_credentials()
    say(f"Logged out of {credentials.url}")
    return 0


def run_status(args: argparse.Namespace) -> int:
    print(status_table(Client.from_config().projects(mine=True)))
    return 0


def dataset_options(args: argparse.Namespace, fmt: str) -> dict[str, Any]:
    """The options the format takes that were given (the server has defaults for the rest)."""
    names = {"images": ("channels", "height", "width"), "text": ("block_size", "vocabulary")}.get(fmt, ())
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def push_dataset(client: Client, args: argparse.Namespace) -> int:
    """The project's dataset id: the given one, or a new dataset from the uploaded file."""
    if args.dataset_id is not None:
        return int(args.dataset_id)
    file: Path = args.dataset
    fmt = args.dataset_format or FORMATS.get(file.suffix.lower())
    if fmt is None:
        raise CrowdtrainError(f"cannot tell {file.name}'s format from its suffix: give --dataset-format")
    options = dataset_options(args, fmt)
    upload = Uploader(client, UploadState.default(), progress=not args.no_progress).upload(file)
    say("checking the dataset on the server...")
    created = client.create_dataset(name=args.dataset_name or file.name, upload=upload, format=fmt, **options)
    say(
        f"dataset {created.get('id')}: {created.get('train_samples')} training samples, "
        f"{created.get('test_samples')} test samples"
    )
    return int(created["id"])


def export_model(args: argparse.Namespace) -> Exported:
    cls = import_class(args.model)
    module = instantiate(cls, parse_kwargs(args.kwargs))
    exported = export(
        module, args.input_shape, input_dtype=args.input_dtype, loss=args.loss, name=cls.__name__
    )
    weights = sum(t.numel() for t in exported.weights.values())
    say(f"exported {cls.__name__}: {len(exported.graph['nodes'])} nodes, {weights:,} weights")
    return exported


def create_project(
    client: Client, args: argparse.Namespace, exported: Exported, dataset: int
) -> dict[str, Any]:
    settings = dict(args.settings) | ({"mode": args.mode} if args.mode else {})
    try:
        return client.create_project(
            name=args.name,
            description=args.description,
            dataset=dataset,
            graph=exported.graph,
            weights=exported.weights_bytes(),
            settings=settings,
            start=args.start,
        )
    except CrowdtrainError as exc:
        if args.dataset_id is not None:
            raise
        raise CrowdtrainError(
            f"{exc} (the dataset is on the server now: use --dataset-id {dataset})"
        ) from exc


def run_push(args: argparse.Namespace) -> int:
    exported = export_model(args)  # before any upload: a model that cannot be exported costs no bandwidth
    client = Client.from_config()
    project = create_project(client, args, exported, push_dataset(client, args))
    say(f"project {project['id']} ({project.get('status')})")
    print(client.absolute(str(project.get("url") or f"/projects/{project['id']}/")))
    return 0


def watch_frame(client: Client, project: int) -> tuple[str, bool, str]:
    """(the frame, whether the target is reached, the project's status)."""
    detail, metrics = client.project(project), client.metrics(project)
    url = client.absolute(str(detail.get("url") or f"/projects/{project}/"))
    frame = render(detail, metrics, url, time.strftime("%H:%M:%S"))
    return frame, target_reached(detail, metrics), str(detail.get("status"))


def show(frame: str) -> None:
    sys.stdout.write(CLEAR + frame + "\n" if sys.stdout.isatty() else frame + "\n\n")
    sys.stdout.flush()


def run_watch(args: argparse.Namespace) -> int:
    client = Client.from_config()
    project = client.resolve_project(args.project)
    deadline = time.monotonic() + args.timeout if args.timeout else None
    while True:
        try:
            frame, reached, status = watch_frame(client, project)
            show(frame)
        except ServerUnreachable as exc:  # a restarting server should not end the watch
            reached, status = False, ""
            say(f"{exc}; retrying")
        if args.until_target and reached:
            return 0
        if args.until_target and status == "finished":
            raise CrowdtrainError("the project finished without reaching its target")
        if deadline is not None and time.monotonic() > deadline:
            say("timed out")
            return 2
        time.sleep(args.interval)


def run_pull(args: argparse.Namespace) -> int:
    client = Client.from_config()
    checkpoint = client.checkpoint(client.resolve_project(args.project), checkpoint_version(args.version))
    output: Path = args.output
    partial = output.with_name(output.name + ".partial")
    partial.write_bytes(checkpoint.data)
    os.replace(partial, output)  # never a half-written file under the name asked for
    metrics = ", ".join(f"{k} {v:.4f}" for k, v in sorted(checkpoint.metrics.items())) or "not evaluated"
    say(f"wrote version {checkpoint.version} of project {checkpoint.project} ({metrics}) to {output}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except CrowdtrainError as exc:
        say(f"crowdtrain: error: {exc}")
        return 1
    except KeyboardInterrupt:
        say("interrupted")
        return 130


__all__ = ["main", "parser"]
