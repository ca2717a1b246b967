"""``Client``: the Crowdtrain REST API (docs: /api/docs/ on the server) over requests, token-authenticated.

Every failure becomes a CrowdtrainError with a sentence for the researcher: the server's own ``detail`` for
an HTTP error, the reason for a connection that failed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin, urlsplit

import requests

from ._version import __version__
from .config import Credentials, load_credentials
from .errors import ApiError, CrowdtrainError, ServerUnreachable, error_detail

TIMEOUT = 60.0  # seconds without a byte from the server (not the whole transfer)
MAX_PAGES = 1000  # a server that links pages in a loop must not hang the client
PROJECT_URL = re.compile(r"/projects/(\d+)/?$")


@dataclass(frozen=True)
class Checkpoint:
    """One version's weights as served: raw safetensors bytes plus what the server said about them."""

    project: int
    version: int
    metrics: dict[str, float]
    data: bytes = field(repr=False)
    filename: str = ""


def normalise_url(url: str) -> str:
    """'host:8000/' -> refused; 'http://host:8000/' -> 'http://host:8000' (the site root, no trailing /)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise CrowdtrainError(f"not a server URL: {url!r} (expected e.g. https://crowdtrain.example.org)")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def login(url: str, username: str, password: str, *, timeout: float = TIMEOUT) -> Credentials:
    """Exchange a researcher's username and password for an API token (POST /api/auth/login/)."""
    client = Client(url, token=None, timeout=timeout)
    body = client.request_json("POST", "/api/auth/login/", auth=(username, password))
    token = body.get("token") if isinstance(body, dict) else None
    if not isinstance(token, str) or not token:
        raise CrowdtrainError(f"{client.url} answered the login without a token: {str(body)[:200]}")
    return Credentials(url=client.url, token=token)


class Client:
    """The API of one server. ``Client.from_config()`` uses ``crowdtrain login``'s stored token."""

    def __init__(self, url: str, token: str | None = None, *, timeout: float = TIMEOUT) -> None:
        self.url = normalise_url(url)
        self.timeout = timeout
        self.session = requests.Session()
        self.session.headers["User-Agent"] = f"crowdtrain-client/{__version__}"
        if token:
            self.session.headers["Authorization"] = f"Token {token}"

    @classmethod
    def from_config(cls) -> Client:
        credentials = load_credentials()
        return cls(credentials.url, credentials.token)

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    def absolute(self, path: str) -> str:
        return urljoin(self.url + "/", path)

    # --- transport ----------------------------------------------------------------------------------

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        """One request; an HTTP error status raises ApiError, no answer raises ServerUnreachable."""
        kwargs.setdefault("timeout", self.timeout)
        try:
            response = self.session.request(method, self.absolute(path), **kwargs)
        except requests.RequestException as exc:
            raise ServerUnreachable(f"cannot reach {self.url} ({method} {path}): {_reason(exc)}") from exc
        if response.status_code >= 400:
            raise _api_error(response, method, path)
        return response

    def request_json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.request(method, path, **kwargs)
        if response.status_code == 204 or not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            raise CrowdtrainError(f"{method} {path} answered with something that is not JSON") from None

    def paginate(self, path: str, params: Mapping[str, str] | None = None) -> Iterator[dict[str, Any]]:
        """Every item of a paginated list, following ``next`` links."""
        page: Any = self.request_json("GET", path, params=params)
        for _ in range(MAX_PAGES):
            yield from _page_items(page)
            following = page.get("next") if isinstance(page, dict) else None
            if not following:
                return
            page = self.request_json("GET", following)

    # --- account ------------------------------------------------------------------------------------

    def me(self) -> dict[str, Any]:
        return dict(self.request_json("GET", "/api/me/"))

    def logout(self) -> None:
        self.request("POST", "/api/auth/logout/")

    # --- projects -----------------------------------------------------------------------------------

    def projects(self, *, mine: bool = True) -> list[dict[str, Any]]:
        return list(self.paginate("/api/projects/", {"mine": "1"} if mine else None))

    def project(self, project: int) -> dict[str, Any]:
        return dict(self.request_json("GET", f"/api/projects/{int(project)}/"))

    def create_project(
        self,
        *,
        name: str,
        dataset: int,
        graph: Mapping[str, Any] | None = None,
        weights: bytes | None = None,
        preset: str | None = None,
        description: str = "",
        settings: Mapping[str, Any] | None = None,
        start: bool = False,
    ) -> dict[str, Any]:
        """A project from an exported graph + safetensors weights, or from a preset (exactly one)."""
        if (preset is None) == (graph is None or weights is None):
            raise CrowdtrainError("a project needs either a preset or both a graph and its weights")
        form = {"name": name, "description": description, "dataset": str(dataset), **_form(settings)}
        if start:
            form["start"] = "true"
        files = None
        if preset is not None:
            form["preset"] = preset
        else:
            graph_json = json.dumps(graph).encode()
            files = {
                "graph": ("graph.json", graph_json, "application/json"),
                "weights": ("weights.safetensors", weights, "application/octet-stream"),
            }
        return dict(self.request_json("POST", "/api/projects/", data=form, files=files))

    def update_project(self, project: int, **fields: Any) -> dict[str, Any]:
        return dict(self.request_json("PATCH", f"/api/projects/{int(project)}/", json=fields))

    def start_project(self, project: int) -> dict[str, Any]:
        return dict(self.request_json("POST", f"/api/projects/{int(project)}/start/"))

    def pause_project(self, project: int) -> dict[str, Any]:
        return dict(self.request_json("POST", f"/api/projects/{int(project)}/pause/"))

    def delete_project(self, project: int) -> None:
        self.request("DELETE", f"/api/projects/{int(project)}/")

    def versions(self, project: int) -> list[dict[str, Any]]:
        return list(self.paginate(f"/api/projects/{int(project)}/versions/"))

    def metrics(self, project: int) -> list[dict[str, Any]]:
        body = self.request_json("GET", f"/api/projects/{int(project)}/metrics/")
        return list(body.get("metrics", [])) if isinstance(body, dict) else []

    def checkpoint(self, project: int, version: str | int = "best") -> Checkpoint:
        """The safetensors bytes of ``version``: "best" (by the target metric), "latest" or a number."""
        params = {"version": checkpoint_version(version)}
        response = self.request("GET", f"/api/projects/{int(project)}/checkpoint/", params=params)
        return Checkpoint(
            project=int(project),
            version=_int_header(response, "X-Crowdtrain-Version"),
            metrics=_metrics_header(response),
            data=response.content,
            filename=_filename(response),
        )

    def resolve_project(self, ref: str | int) -> int:
        """A project id from an id, a project page URL or the exact name of one of your projects."""
        text = str(ref).strip()
        if text.isdigit():
            return int(text)
        match = PROJECT_URL.search(urlsplit(text).path) if "://" in text else None
        if match:
            return int(match.group(1))
        ids = [int(p["id"]) for p in self.projects(mine=True) if p.get("name") == text]
        if len(ids) != 1:
            found = "none" if not ids else f"{len(ids)}: ids {ids}"
            raise CrowdtrainError(f"no single project of yours is named {text!r} ({found}); give its id")
        return ids[0]

    # --- datasets -----------------------------------------------------------------------------------

    def datasets(self) -> list[dict[str, Any]]:
        return list(self.paginate("/api/datasets/"))

    def create_dataset(self, *, name: str, upload: str, format: str, **options: Any) -> dict[str, Any]:
        """A dataset from a complete upload; ``options``: channels/height/width (images), block_size and
        vocabulary (text)."""
        body = {"name": name, "upload": upload, "format": format, **options}
        return dict(self.request_json("POST", "/api/datasets/", json=body))

    def delete_dataset(self, dataset: int) -> None:
        self.request("DELETE", f"/api/datasets/{int(dataset)}/")

    def upload_create(self, *, filename: str, size: int) -> dict[str, Any]:
        return dict(self.request_json("POST", "/api/uploads/", json={"filename": filename, "size": size}))

    def upload_status(self, upload: str) -> dict[str, Any]:
        return dict(self.request_json("GET", f"/api/uploads/{upload}/"))

    def upload_put(self, upload: str, offset: int, chunk: bytes) -> dict[str, Any]:
        headers = {"Upload-Offset": str(offset), "Content-Type": "application/octet-stream"}
        return dict(self.request_json("PUT", f"/api/uploads/{upload}/", data=chunk, headers=headers))


def checkpoint_version(version: str | int) -> str:
    text = str(version).strip()
    if text in ("best", "latest") or (text.isdigit() and not isinstance(version, bool)):
        return text
    raise CrowdtrainError(f"a version is 'best', 'latest' or a number; got {version!r}")


def _form(settings: Mapping[str, Any] | None) -> dict[str, str]:
    """Training settings as multipart fields: booleans as true/false, None as an empty field."""
    out = {}
    for key, value in (settings or {}).items():
        if isinstance(value, bool):
            out[key] = "true" if value else "false"
        else:
            out[key] = "" if value is None else str(value)
    return out


def _page_items(page: Any) -> list[dict[str, Any]]:
    if isinstance(page, dict) and isinstance(page.get("results"), list):
        return list(page["results"])
    if isinstance(page, list):  # an unpaginated list
        return page
    raise CrowdtrainError(f"expected a paginated list, got {str(page)[:200]}")


def _reason(exc: requests.RequestException) -> str:
    if isinstance(exc, requests.Timeout):
        return "no answer in time"
    if isinstance(exc, requests.ConnectionError):
        return "connection failed (is the server running, and the URL right?)"
    return str(exc) or type(exc).__name__


def _api_error(response: requests.Response, method: str, path: str) -> ApiError:
    try:
        detail = error_detail(response.json())
    except ValueError:
        detail = response.reason or "no detail"
    if response.status_code == 401:
        detail += " (log in again: `crowdtrain login URL`)"
    return ApiError(response.status_code, detail, method, path)


def _int_header(response: requests.Response, name: str) -> int:
    value = response.headers.get(name, "")
    if not value.isdigit():
        raise CrowdtrainError(f"the server sent no valid {name} header ({value!r})")
    return int(value)


def _metrics_header(response: requests.Response) -> dict[str, float]:
    try:
        metrics = json.loads(response.headers.get("X-Crowdtrain-Metrics") or "{}")
    except ValueError:
        return {}
    if not isinstance(metrics, dict):
        return {}
    return {str(k): float(v) for k, v in metrics.items() if isinstance(v, int | float)}


def _filename(response: requests.Response) -> str:
    match = re.search(r'filename="([^"/\\]+)"', response.headers.get("Content-Disposition", ""))
    return match.group(1) if match else ""
