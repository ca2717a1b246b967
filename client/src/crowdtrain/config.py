"""Where the client keeps the server URL and token: the environment first, then a private config file.

``CROWDTRAIN_URL`` / ``CROWDTRAIN_TOKEN`` win over ``$XDG_CONFIG_HOME/crowdtrain/config.json`` (by default
``~/.config/crowdtrain/config.json``), which only its owner may read: the token is a password.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CrowdtrainError, NotLoggedIn

URL_ENV, TOKEN_ENV = "CROWDTRAIN_URL", "CROWDTRAIN_TOKEN"
FILE_MODE, DIR_MODE = 0o600, 0o700


@dataclass(frozen=True)
class Credentials:
    url: str
    token: str


def config_dir(environ: Mapping[str, str] = os.environ) -> Path:
    base = environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "crowdtrain"


def config_path(environ: Mapping[str, str] = os.environ) -> Path:
    return config_dir(environ) / "config.json"


def read_private_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or {} when there is none; a corrupt file is an error, not a reset."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise CrowdtrainError(f"cannot read {path}: {exc}; delete it and log in again") from None
    if not isinstance(data, dict):
        raise CrowdtrainError(f"{path} does not hold a JSON object; delete it and log in again")
    return data


def write_private_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` readable by its owner only, replacing the file atomically (never briefly public)."""
    path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        os.fchmod(handle.fileno(), FILE_MODE)  # O_CREAT's mode does not apply to a file left by a crash
        json.dump(dict(data), handle, indent=2)
    os.replace(partial, path)


def save_credentials(credentials: Credentials, environ: Mapping[str, str] = os.environ) -> Path:
    path = config_path(environ)
    write_private_json(path, {**read_private_json(path), "url": credentials.url, "token": credentials.token})
    return path


def forget_credentials(environ: Mapping[str, str] = os.environ) -> None:
    path = config_path(environ)
    data = read_private_json(path)
    if "token" in data:
        del data["token"]
        write_private_json(path, data)


def load_credentials(environ: Mapping[str, str] = os.environ) -> Credentials:
    stored = read_private_json(config_path(environ))
    url = environ.get(URL_ENV) or stored.get("url")
    token = environ.get(TOKEN_ENV) or stored.get("token")
    if not isinstance(url, str) or not url:
        raise NotLoggedIn(f"no server: run `crowdtrain login URL` or set {URL_ENV} and {TOKEN_ENV}")
    if not isinstance(token, str) or not token:
        raise NotLoggedIn(f"not logged in to {url}: run `crowdtrain login {url}` or set {TOKEN_ENV}")
    return Credentials(url=url, token=token)
