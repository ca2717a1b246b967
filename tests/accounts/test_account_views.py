"""/account/ for a volunteer: what the page shows, the profile form, renaming and forgetting devices, the
download of one's data and the deletion of the account; each refusing anyone else's rows and bad input."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

from frontend.templatetags.crowdtrain import format_credit
from projects.models import Result
from tests.accounts.conftest import GFLOP, PASSWORD, History, totals
from tests.workers.conftest import device_of
from workers.credit import credit_from_flops
from workers.models import CreditEntry, Device, Volunteer

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice(client: Client, history: History) -> Client:
    client.force_login(history.user)
    return client


def page(client: Client) -> str:
    response = client.get("/account/")
    assert response.status_code == 200
    return response.content.decode()


def test_the_page_shows_the_volunteers_own_account(alice: Client, history: History) -> None:
    html = page(alice)
    assert 'href="/account/preferences/"' in html and 'href="/teams/"' in html
    assert "Gradient Descenders" in html and f'href="/teams/{history.team.pk}/"' in html
    assert f'data-device="{history.laptop.pk}"' in html and f'data-device="{history.phone.pk}"' in html
    assert "bob-id" not in html and "laptop-id" not in html  # browsers' ids are never shown
    # Credit per project, from the ledger: 3 and 5 GFLOP in the two projects.
    for project, flops in zip(history.projects, (3 * GFLOP, 5 * GFLOP), strict=True):
        assert f'href="/projects/{project.pk}/"' in html
        assert f'<td class="num">{format_credit(credit_from_flops(flops))}</td>' in html
    # Recent results and their outcomes.
    for outcome in ("Valid, credited", "Invalid", "Computing", "NaN in update"):
        assert outcome in html
    assert "alice@example.org" in html and "verified" in html


def test_a_new_volunteer_sees_empty_sections_and_no_email_warning(
    client: Client, volunteer_user: User
) -> None:
    client.force_login(volunteer_user)
    html = page(client)
    assert "No devices yet" in html and "No credit yet" in html and "No results yet" in html
    assert "No e-mail address" in html and "Join or create a team" in html


def test_the_profile_form_saves_a_name_a_country_and_a_site(alice: Client, history: History) -> None:
    data = {"display_name": "  Alice   L. ", "country": "NZ", "url": "alice.example.org/about"}
    response = alice.post("/account/profile/", data)
    assert response.status_code == 302
    volunteer = Volunteer.objects.get(user=history.user)
    assert (volunteer.display_name, volunteer.country, volunteer.url) == (
        "Alice L.",
        "NZ",
        "https://alice.example.org/about",
    )
    html = page(alice)
    assert '<option value="NZ" selected>New Zealand</option>' in html


@pytest.mark.parametrize(
    "field, value",
    [
        ("display_name", "x" * 101),
        ("display_name", "evil\u202egnp.exe"),  # right-to-left override
        ("display_name", "zero\u200bwidth"),
        ("country", "ZZ"),
        ("country", "FRA"),
        ("url", "javascript:alert(1)"),
        ("url", "ftp://files.example.org/"),
        ("url", "https://example.org/" + "a" * 300),
    ],
)
def test_the_profile_form_refuses_bad_values(alice: Client, history: History, field: str, value: str) -> None:
    data = {"display_name": "Alice", "country": "", "url": ""} | {field: value}
    response = alice.post("/account/profile/", data)
    assert response.status_code == 400 and 'class="errorlist' in response.content.decode()
    volunteer = Volunteer.objects.get(user=history.user)
    assert (volunteer.display_name, volunteer.country, volunteer.url) == ("", "", "")


def test_a_device_is_renamed_from_the_page(alice: Client, history: History) -> None:
    response = alice.post(f"/account/devices/{history.laptop.pk}/name/", {"name": " Kitchen  laptop "})
    assert response.status_code == 302
    assert Device.objects.get(pk=history.laptop.pk).name == "Kitchen laptop"
    assert 'value="Kitchen laptop"' in page(alice)


@pytest.mark.parametrize("name", ["y" * 61, "tab\tin\x00name"])
def test_a_bad_device_name_is_refused(alice: Client, history: History, name: str) -> None:
    response = alice.post(f"/account/devices/{history.laptop.pk}/name/", {"name": name}, follow=True)
    assert response.status_code == 200 and 'class="message message-error"' in response.content.decode()
    assert Device.objects.get(pk=history.laptop.pk).name == ""


def test_anothers_device_is_a_404_for_every_action(client: Client, history: History) -> None:
    bobs = device_of(history.other, "bob-phone")
    client.force_login(history.user)
    for path in (f"/account/devices/{bobs.pk}/name/", f"/account/devices/{bobs.pk}/forget/"):
        assert client.post(path, {"name": "stolen"}).status_code == 404
    bobs.refresh_from_db()
    assert bobs.name == "" and bobs.forgotten_at is None and bobs.client_id == "bob-phone"


@pytest.mark.parametrize("device_id", ["0", "99999999999", "9" * 30])
def test_unknown_and_absurd_device_ids_are_404s(alice: Client, device_id: str) -> None:
    assert alice.post(f"/account/devices/{device_id}/name/", {"name": "x"}).status_code == 404
    assert alice.post(f"/account/devices/{device_id}/forget/").status_code == 404


def test_actions_need_a_post_and_a_login(client: Client, history: History) -> None:
    path = f"/account/devices/{history.laptop.pk}/forget/"
    assert client.post(path).status_code == 302  # to the login page
    client.force_login(history.user)
    assert client.get(path).status_code == 405
    assert client.get("/account/profile/").status_code == 405
    assert Device.objects.get(pk=history.laptop.pk).forgotten_at is None


def test_forgetting_from_the_page_hides_the_device_and_keeps_the_totals(
    alice: Client, history: History
) -> None:
    before = totals(history)
    assert alice.post(f"/account/devices/{history.laptop.pk}/forget/").status_code == 302
    assert alice.post(f"/account/devices/{history.phone.pk}/forget/").status_code == 302
    html = page(alice)
    assert "data-device=" not in html and "No devices yet" in html
    assert totals(history) == before
    assert alice.post(f"/account/devices/{history.laptop.pk}/forget/").status_code == 404  # gone from view


def export(client: Client) -> dict[str, Any]:
    response = client.get("/account/export/")
    assert response.status_code == 200 and response["Content-Type"].startswith("application/json")
    assert response["Content-Disposition"].startswith("attachment;")
    return json.loads(b"".join(response.streaming_content))  # type: ignore[attr-defined]


def test_the_export_holds_all_of_the_users_data(alice: Client, history: History) -> None:
    data = export(alice)
    assert data["account"]["username"] == "alice"
    assert data["account"]["email_addresses"] == [
        {"email": "alice@example.org", "verified": True, "primary": True}
    ]
    assert data["volunteer"]["team"] == {"id": history.team.pk, "name": "Gradient Descenders"}
    assert data["volunteer"]["total_flops"] == 8 * GFLOP
    assert {d["id"] for d in data["devices"]} == {history.laptop.pk, history.phone.pk}
    mine = CreditEntry.objects.filter(volunteer__user=history.user)
    assert sorted(e["id"] for e in data["credit_entries"]) == sorted(mine.values_list("pk", flat=True))
    assert sum(e["flops"] for e in data["credit_entries"]) == 8 * GFLOP
    results = {r["id"]: r for r in data["results"]}
    assert set(results) == set(Result.objects.filter(volunteer=history.user).values_list("pk", flat=True))
    assert results[history.results["invalid"].pk]["reason"] == "NaN in update"
    assert results[history.results["valid"].pk]["project_id"] == history.projects[1].pk


def test_the_export_leaks_no_secret_and_nobody_elses_data(alice: Client, history: History) -> None:
    text = json.dumps(export(alice))
    password_hash = User.objects.get(pk=history.user.pk).password
    for secret in (password_hash, password_hash.split("$")[-1], "laptop-id", "phone-id", "client_id"):
        assert secret not in text
    for others in ("bob", "bob-id", str(7 * GFLOP)):
        assert others not in text


def test_the_export_of_a_large_history_comes_in_pieces(
    alice: Client, history: History, monkeypatch: Any
) -> None:
    from accounts import export as export_module

    monkeypatch.setattr(export_module, "PAGE_ROWS", 2)  # several pages of results and ledger lines
    response = alice.get("/account/export/")
    pieces = list(response.streaming_content)  # type: ignore[attr-defined]
    data = json.loads(b"".join(pieces))
    assert len(data["results"]) == 4 and len(data["credit_entries"]) == 2
    assert len(pieces) > 10 and max(map(len, pieces)) < 2000


def test_downloads_of_ones_data_are_throttled(alice: Client) -> None:
    statuses = [alice.get("/account/export/").status_code for _ in range(21)]
    assert statuses == [200] * 20 + [429]


def test_deletion_asks_for_the_password(alice: Client, history: History) -> None:
    html = alice.get("/account/delete/").content.decode()
    assert 'name="password"' in html and "cannot be undone" in html
    response = alice.post("/account/delete/", {"password": "not-my-password"})
    assert response.status_code == 400 and "That is not your password" in response.content.decode()
    assert alice.post("/account/delete/", {}).status_code == 400
    assert alice.post("/account/delete/", {"password": "p" * 100_000}).status_code == 400
    assert User.objects.filter(pk=history.user.pk).exists()


def test_wrong_passwords_on_deletion_are_throttled_as_logins(alice: Client, history: History) -> None:
    statuses = [alice.post("/account/delete/", {"password": "guess"}).status_code for _ in range(11)]
    assert statuses == [400] * 10 + [429]
    # Spent: even the right password waits for the window, as on the login page.
    assert alice.post("/account/delete/", {"password": PASSWORD}).status_code == 429
    assert User.objects.filter(pk=history.user.pk).exists()


def test_deleting_the_account_logs_out_and_keeps_every_total(alice: Client, history: History) -> None:
    before = totals(history)
    response = alice.post("/account/delete/", {"password": PASSWORD}, follow=True)
    assert response.status_code == 200 and "Your account is deleted" in response.content.decode()
    assert not User.objects.filter(username="alice").exists()
    assert totals(history) == before
    assert alice.get("/account/").status_code == 302  # logged out
    # The public pages show the credit under the stand-in's name, never alice's.
    for path in ("/leaderboard/", f"/teams/{history.team.pk}/", "/"):
        html = alice.get(path).content.decode()
        assert "alice" not in html.lower()


def test_an_owner_of_projects_is_refused_deletion(client: Client, researcher: User, history: History) -> None:
    client.force_login(researcher)
    response = client.post("/account/delete/", {"password": "research-pass-123"})
    assert response.status_code == 409 and "projects or datasets" in response.content.decode()
    assert User.objects.filter(pk=researcher.pk).exists()


@pytest.mark.django_db(transaction=True)
def test_under_asgi_the_export_is_streamed_not_read_whole(volunteer_user: User, recwarn: Any) -> None:
    """daphne serves through ASGI, where Django would read a synchronous iterator whole (and warn)."""
    from asgiref.sync import sync_to_async
    from django.db import connections
    from django.test import AsyncClient

    from tests.conftest import run_async

    async def fetch() -> bytes:
        client = AsyncClient()
        await client.aforce_login(volunteer_user)
        response: Any = await client.get("/account/export/")
        assert response.status_code == 200 and response.is_async
        body = b"".join([chunk async for chunk in response.streaming_content])
        # The login ran in asgiref's thread, outside any request: its connection would outlive the test.
        await sync_to_async(connections.close_all, thread_sensitive=True)()
        return body

    data = json.loads(run_async(fetch()))
    assert data["account"]["username"] == "alice" and data["results"] == []
    assert not [w for w in recwarn if "StreamingHttpResponse" in str(w.message)]
