"""A researcher creates a conv, a text and a regression model in the admin, each on a dataset uploaded there
(a zip of image folders, a text corpus, an .npz of float targets), starts them, and one volunteer's browser
trains all three to a stated test accuracy / loss, against the real, separately running stack.

Targets (each the best evaluated version's test metric, within TRAINING_MINUTES of the volunteer starting):
- conv (cnn preset, 4 classes of shapes): accuracy >= 0.75, three times chance (0.25). Measured on this 2-core
  machine under heavy load (load average 10-20): 0.98 at version 4, 245 s (another run: 0.80 after 179 s).
- text (gpt preset, char-level): loss <= ln(vocabulary) - 0.75, i.e. 0.75 nats below guessing uniformly
  (ln 58 = 4.06); learning the character frequencies is enough. Measured: 3.27 at version 1, 122 s.
- regression (an uploaded MLP, mse): loss <= 0.1 x the test targets' variance (0.073; R^2 >= 0.9, the noise
  floor is ~0.4% of it). Measured: 0.070 at version 1, 130 s (0.016 at version 3).
Each round is one whole unit (WHOLE_UNITS below), so the versions are the same on a fast or a loaded
machine: with 8 CPU-bound processes beside the test, 3.268 at version 1 (51 s), 0.070 at version 1 (54 s) and
0.98 at version 4 (118 s); with the old 5 s units the gpt's version 1 there was 3.348.
"""

from __future__ import annotations

import io
import json
import math
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psycopg
import pytest
import torch
from PIL import Image, ImageDraw
from torch import nn

from devstack.stack import ROOT, Stack
from engine import codecs
from engine.export import export_module
from projects.demo import MNIST_DEMO
from tests.e2e.test_volunteer_journey import sign_up

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(1200)]
SHOTS = ROOT / "test-artifacts" / "screenshots"
DEMO_TEXT = ROOT / "projects" / "demo_data" / "kjv.txt"
ADMIN = ("admin", "admin-e2e-password")  # Stack.env()'s CROWDTRAIN_ADMIN_USER / _PASSWORD
TRAINING_MINUTES = 5.0

# --- the three datasets, made here --------------------------------------------------------------

SHAPES = ("circle", "cross", "square", "triangle")
# Each class its own shape and colour (their grey levels differ too: the cnn preset takes 1 channel), at a
# random place and size on a random dark background.
COLOURS = {
    "circle": (255, 40, 40),
    "cross": (255, 255, 255),
    "square": (255, 220, 0),
    "triangle": (40, 40, 255),
}


def shape_image(shape: str, rng: np.random.Generator) -> bytes:
    image = Image.new("RGB", (32, 32), tuple(int(v) for v in rng.integers(0, 30, 3)))
    r = int(rng.integers(9, 13))
    cx, cy = (int(v) for v in rng.integers(r + 1, 31 - r, 2))
    draw, colour = ImageDraw.Draw(image), COLOURS[shape]
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    else:
        draw.line((cx - r, cy, cx + r, cy), fill=colour, width=5)
        draw.line((cx, cy - r, cx, cy + r), fill=colour, width=5)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def shapes_zip(path: Path, train: int, test: int) -> Path:
    """ImageFolder layout, 32x32 RGB PNGs: the admin converts them to 1x28x28, as the cnn preset takes."""
    rng = np.random.default_rng(0)
    with zipfile.ZipFile(path, "w") as archive:
        for split, per_class in (("train", train), ("test", test)):
            for shape in SHAPES:
                for i in range(per_class):
                    archive.writestr(f"{split}/{shape}/{i:03d}.png", shape_image(shape, rng))
    return path


def regression_npz(path: Path, train: int, test: int) -> float:
    """y = W x + noise, 8 inputs to 2 targets; the variance of the test targets (the loss of predicting
    their mean), which the trained model must beat by far."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 2)).astype(np.float32) / math.sqrt(8)
    x = rng.normal(size=(train + test, 8)).astype(np.float32)
    y = (x @ w + 0.05 * rng.normal(size=(train + test, 2))).astype(np.float32)
    np.savez(path, x=x[:train], y=y[:train], x_test=x[train:], y_test=y[train:])
    return float(y[train:].var(axis=0).mean())


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def exported_regressor(directory: Path) -> tuple[Path, Path]:
    """What `manage.py export_model tests...:Regressor --input-shape 8 --loss mse` writes, to upload."""
    graph, weights = export_module(Regressor(), (8,), loss="mse", name="regressor")
    graph_path, weights_path = directory / "graph.json", directory / "weights.safetensors"
    graph_path.write_text(json.dumps(graph))
    weights_path.write_bytes(codecs.encode(weights))
    return graph_path, weights_path


# --- what each project must reach ---------------------------------------------------------------


@dataclass(frozen=True)
class Goal:
    project: str
    metric: str  # "test_accuracy" (higher is better) or "test_loss" (lower is better)
    value: float

    def met(self, best: float | None) -> bool:
        if best is None:
            return False
        return best >= self.value if self.metric == "test_accuracy" else best <= self.value


def best_metric(stack: Stack, goal: Goal) -> float | None:
    best = "max" if goal.metric == "test_accuracy" else "min"
    with psycopg.connect(stack.database_url) as conn:
        row = conn.execute(
            f"SELECT {best}(m.value) FROM projects_metric m JOIN projects_project p ON p.id = m.project_id "
            "WHERE p.name = %s AND m.name = %s",
            (goal.project, goal.metric),
        ).fetchone()
    return float(row[0]) if row and row[0] is not None else None


def versions(stack: Stack, project: str) -> int:
    with psycopg.connect(stack.database_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM projects_modelversion v JOIN projects_project p ON p.id = v.project_id "
            "WHERE p.name = %s",
            (project,),
        ).fetchone()
    return int(row[0]) - 1 if row else 0


# --- the admin, through its pages ---------------------------------------------------------------


def admin_login(page, stack: Stack) -> None:
    page.goto(stack.url + "/admin/login/?next=/admin/")
    page.fill("input[name=username]", ADMIN[0])
    page.fill("input[name=password]", ADMIN[1])
    page.click("input[type=submit]")
    page.wait_for_selector("#site-name")


def saved(page, what: str) -> None:
    page.wait_for_load_state()
    success = page.locator(".messagelist .success")
    errors = page.locator(".errorlist, .messagelist .error")
    assert success.count() and not errors.count(), f"{what} not saved: {page.inner_text('#content')[:3000]}"


def upload_dataset(page, stack: Stack, name: str, path: Path, fmt: str, selects: dict[str, str]) -> None:
    page.goto(stack.url + "/admin/projects/dataset/add/")
    page.fill("input[name=name]", name)
    page.check(f"input[name=format][value={fmt}]")
    page.set_input_files("input[name=file]", str(path))
    for field, value in selects.items():
        page.select_option(f"select[name={field}]", value)
    page.click("input[name=_save]")
    saved(page, f"dataset {name}")


def fill_settings(page, settings: dict[str, str]) -> None:
    for field, value in settings.items():
        selector = f"[name={field}]"
        if page.locator(f"select{selector}").count():
            page.select_option(f"select{selector}", value)
        else:
            page.fill(f"input{selector}", value)


def add_project(page, stack: Stack, name: str, model: dict[str, str], settings: dict[str, str]) -> None:
    """`model` is {"preset": name} or {"graph_file": path, "weights_file": path}; `settings` holds the
    dataset (by name, or an .npz as "dataset_file") and training settings."""
    page.goto(stack.url + "/admin/projects/project/add/")
    page.fill("input[name=name]", name)
    if "preset" in model:
        page.check("input[name=model_source][value=preset]")
        page.select_option("select[name=preset]", model["preset"])
    else:
        page.check("input[name=model_source][value=upload]")
        for field, path in model.items():
            page.set_input_files(f"input[name={field}]", path)
    settings = dict(settings)
    if "dataset" in settings:
        option = page.locator("select[name=dataset] option", has_text=settings.pop("dataset") + " (")
        page.select_option("select[name=dataset]", option.get_attribute("value"))
    if "dataset_file" in settings:
        page.set_input_files("input[name=dataset_file]", settings.pop("dataset_file"))
    fill_settings(page, settings)
    page.click("input[name=_save]")
    saved(page, f"project {name}")


def apply_action(page, stack: Stack, action: str, projects: list[str]) -> None:
    page.goto(stack.url + "/admin/projects/project/")
    for name in projects:
        page.locator("#result_list tr", has_text=name).locator("input.action-select").check()
    page.select_option("select[name=action]", action)
    page.click("button[name=index]")
    saved(page, f"{action} of {projects}")


# --- the volunteer ------------------------------------------------------------------------------


def train_until(
    page, stack: Stack, goals: list[Goal], minutes: float
) -> dict[str, tuple[float | None, float]]:
    """Each goal's best metric and the seconds it took to meet it (or the whole wait, if it never did)."""
    start = time.monotonic()
    reached: dict[str, tuple[float | None, float]] = {}
    while time.monotonic() - start < minutes * 60 and len(reached) < len(goals):
        page.wait_for_timeout(2000)
        for goal in goals:
            best = best_metric(stack, goal)
            if goal.project not in reached and goal.met(best):
                reached[goal.project] = (best, time.monotonic() - start)
        print(
            f"{time.monotonic() - start:6.1f}s",
            {g.project: (versions(stack, g.project), best_metric(stack, g)) for g in goals},
            flush=True,
        )
    elapsed = time.monotonic() - start
    return {g.project: reached.get(g.project, (best_metric(stack, g), elapsed)) for g in goals}


# --- the test -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    var_dir = tmp_path_factory.mktemp("e2e-admin-models")
    env = {"CROWDTRAIN_EVAL_EVERY": "1"}
    stack = Stack(
        var_dir=var_dir,
        database="crowdtrain_e2e_h2",
        redis_db=9,
        extra_env=env,
        startup_timeout=240,
    )
    with stack as running:
        yield running


CONV, TEXT, REGRESSION = "Shapes CNN", "KJV GPT", "Linear map MLP"
# Plain SGD needs dozens of steps here (the cnn preset ~40-90, measured offline in torch on these data), and
# on a loaded machine each round takes tens of seconds: averaging mode takes 8 (cnn, mlp) or 4 (gpt) local
# steps per work unit, so each round moves the model further. Targets were measured with these settings.
# Each round is one whole unit of round_samples on any machine: units are sized to the device's measured
# speed (at most batch_size) and a round closes at round_timeout with what it has, so with 5 s units and a
# 15 s timeout a slow CI machine trained on slivers (the gpt's best was 3.317 after 300 s there, against
# 3.268 at version 1 here). The timeout only matters if a unit is lost; a round closes when its unit is in.
WHOLE_UNITS = {"round_timeout": "120", "target_seconds": "60", "codec": "fp32"}
LOCAL = {"mode": "averaging", "learning_rate": "1.0", "momentum": "0.0", "local_momentum": "0.9"}
SETTINGS = {
    CONV: {
        **WHOLE_UNITS,
        **LOCAL,
        "dataset": "shapes",
        "local_learning_rate": "0.05",
        "local_batch_size": "16",
    }
    | {"batch_size": "128", "round_samples": "128"},
    TEXT: {**WHOLE_UNITS, **LOCAL, "dataset": "kjv", "local_learning_rate": "0.1", "local_batch_size": "4"}
    | {"batch_size": "16", "round_samples": "16"},
    REGRESSION: {**WHOLE_UNITS, **LOCAL, "local_learning_rate": "0.2", "local_momentum": "0.5"}
    | {"local_batch_size": "32", "batch_size": "256", "round_samples": "256"},
}


def test_conv_text_and_regression_models_from_the_admin_train_in_a_browser(
    stack: Stack, browser, tmp_path: Path
) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    target_variance = regression_npz(tmp_path / "linear.npz", train=512, test=128)
    graph, weights = exported_regressor(tmp_path)
    (tmp_path / "kjv.txt").write_text(DEMO_TEXT.read_text()[:20000])
    t0 = time.monotonic()

    researcher = browser.new_context().new_page()
    admin_login(researcher, stack)
    upload_dataset(researcher, stack, "shapes", shapes_zip(tmp_path / "shapes.zip", 64, 16), "images", {})
    upload_dataset(researcher, stack, "kjv", tmp_path / "kjv.txt", "text", {})
    add_project(researcher, stack, CONV, {"preset": "cnn"}, SETTINGS[CONV])
    add_project(researcher, stack, TEXT, {"preset": "gpt"}, SETTINGS[TEXT])
    regression = {**SETTINGS[REGRESSION], "dataset_file": str(tmp_path / "linear.npz")}
    add_project(
        researcher, stack, REGRESSION, {"graph_file": str(graph), "weights_file": str(weights)}, regression
    )
    apply_action(researcher, stack, "pause", [MNIST_DEMO.project])
    apply_action(researcher, stack, "start", [CONV, TEXT, REGRESSION])
    print(f"admin: {time.monotonic() - t0:.1f}s", flush=True)

    vocabulary = len(set(DEMO_TEXT.read_text()[:20000]))
    goals = [
        Goal(CONV, "test_accuracy", 0.75),
        Goal(TEXT, "test_loss", math.log(vocabulary) - 0.75),
        Goal(REGRESSION, "test_loss", 0.1 * target_variance),
    ]
    volunteer = browser.new_context().new_page()
    console: list[str] = []  # the page's and its Web Worker's, for the failure message
    volunteer.on("console", lambda message: console.append(f"{message.type}: {message.text}"))
    sign_up(volunteer, stack, "shapes-volunteer")
    volunteer.goto(stack.url + "/contribute/")
    volunteer.click("#contribute")
    results = train_until(volunteer, stack, goals, TRAINING_MINUTES)
    volunteer.screenshot(path=str(SHOTS / "admin-models-contribute.png"), full_page=True)
    print(results, flush=True)
    for goal in goals:
        best, seconds = results[goal.project]
        assert goal.met(best), f"{goal}: best {best} after {seconds:.0f}s\n{stack.failure_report(console)}"
