"""accounts/services.py on a volunteer's own account: the profile, renaming and forgetting devices (only
one's own), and deleting the account with every ledger total left exactly as it was."""

from __future__ import annotations

from io import StringIO

import pytest
from allauth.account.models import EmailAddress
from django.contrib.auth.models import User
from django.core.management import call_command
from knox.models import AuthToken

from accounts.models import ResearcherRequest
from accounts.services import (
    AccountError,
    account_delete,
    api_token_create,
    device_forget,
    device_rename,
    researcher_request_create,
    volunteer_profile_update,
)
from projects.models import Result, WorkUnit
from tests.accounts.conftest import GFLOP, History, totals
from tests.workers.conftest import device_of, grant
from workers.models import ComputingPreferences, CreditEntry, Device, Team, Volunteer
from workers.services import device_register

pytestmark = pytest.mark.django_db


def test_the_profile_is_saved_without_touching_the_credit(history: History) -> None:
    before = Volunteer.objects.get(user=history.user)
    volunteer = volunteer_profile_update(
        user=history.user, display_name="Alice L.", country="FR", url="https://alice.example.org/"
    )
    volunteer.refresh_from_db()
    assert (volunteer.display_name, volunteer.country, volunteer.url) == (
        "Alice L.",
        "FR",
        "https://alice.example.org/",
    )
    assert volunteer.public_name() == "Alice L."
    assert (volunteer.total_flops, volunteer.expavg_credit) == (before.total_flops, before.expavg_credit)


def test_a_device_is_renamed_by_its_owner_only(history: History) -> None:
    assert device_rename(user=history.user, device_id=history.laptop.pk, name="Kitchen laptop").name == (
        "Kitchen laptop"
    )
    assert Device.objects.get(pk=history.laptop.pk).name == "Kitchen laptop"
    with pytest.raises(Device.DoesNotExist):
        device_rename(user=history.other, device_id=history.laptop.pk, name="Mine now")
    with pytest.raises(Device.DoesNotExist):
        device_rename(user=history.user, device_id=10**15, name="Nothing")
    assert Device.objects.get(pk=history.laptop.pk).name == "Kitchen laptop"


def test_a_device_that_never_computed_is_deleted_when_forgotten(history: History) -> None:
    assert device_forget(user=history.user, device_id=history.phone.pk) is True
    assert not Device.objects.filter(pk=history.phone.pk).exists()


def test_a_connected_device_is_kept_even_without_credit(history: History) -> None:
    tablet = device_of(history.user, "tablet-id")  # connected: its page may be asking for work right now
    assert device_forget(user=history.user, device_id=tablet.pk) is False
    assert Device.objects.get(pk=tablet.pk).forgotten_at is not None


def test_a_credited_device_is_hidden_and_detached_with_its_credit_kept(history: History) -> None:
    before = totals(history)
    Device.objects.filter(pk=history.laptop.pk).update(name="Work laptop")

    assert device_forget(user=history.user, device_id=history.laptop.pk) is False

    laptop = Device.objects.get(pk=history.laptop.pk)
    assert laptop.forgotten_at is not None and laptop.client_id.startswith("forgotten:")
    assert (laptop.name, laptop.user_agent) == ("", "")
    assert totals(history) == before
    assert Result.objects.filter(device=laptop).count() == 4  # its results still point at it
    # The same browser coming back is a new device: the forgotten one stays as it was.
    again = device_register(
        user=history.user, client_id="laptop-id", backend="webgl", gflops=1, user_agent="x"
    )
    assert again.pk != laptop.pk and again.total_flops == 0
    # Forgotten is final: neither renamed nor forgotten again, by anyone.
    with pytest.raises(Device.DoesNotExist):
        device_rename(user=history.user, device_id=laptop.pk, name="back")
    with pytest.raises(Device.DoesNotExist):
        device_forget(user=history.user, device_id=laptop.pk)


def test_nobody_forgets_anothers_device(history: History) -> None:
    with pytest.raises(Device.DoesNotExist):
        device_forget(user=history.other, device_id=history.phone.pk)
    with pytest.raises(Device.DoesNotExist):
        device_forget(user=history.other, device_id=history.laptop.pk)
    assert Device.objects.filter(pk=history.phone.pk, forgotten_at__isnull=True).exists()
    assert Device.objects.get(pk=history.laptop.pk).client_id == "laptop-id"


def test_forgotten_devices_free_their_place_under_the_per_volunteer_cap(history: History) -> None:
    from workers import services

    cap = services.MAX_DEVICES_PER_VOLUNTEER
    for index in range(cap - 2):  # alice has two browsers already
        device_of(history.user, f"browser-{index}")
    assert device_of(history.user, "one-too-many").client_id == "unknown:webgl"
    device_forget(user=history.user, device_id=history.laptop.pk)
    assert device_of(history.user, "welcome-back").client_id == "welcome-back"


def test_deleting_an_account_keeps_every_total_exact(history: History) -> None:
    before = totals(history)
    lines = list(CreditEntry.objects.order_by("pk").values_list("pk", "flops", "project_id", "team_id"))
    volunteer_id = Volunteer.objects.get(user=history.user).pk

    stand_in = account_delete(user=history.user)

    assert stand_in is not None and totals(history) == before
    assert (
        list(CreditEntry.objects.order_by("pk").values_list("pk", "flops", "project_id", "team_id")) == lines
    )
    volunteer = Volunteer.objects.get(pk=volunteer_id)
    assert volunteer.user == stand_in and volunteer.total_flops == 8 * GFLOP
    assert ledger_of(volunteer) == volunteer.total_flops
    assert not User.objects.filter(username="alice").exists()
    assert Result.objects.filter(volunteer=stand_in).count() == 4


def ledger_of(volunteer: Volunteer) -> int:
    return sum(CreditEntry.objects.filter(volunteer=volunteer).values_list("flops", flat=True))


def test_the_stand_in_cannot_log_in_and_carries_nothing_of_the_old_account(history: History) -> None:
    volunteer_profile_update(
        user=history.user, display_name="Alice L.", country="FR", url="https://a.example/"
    )
    Device.objects.filter(pk=history.laptop.pk).update(name="Alice's laptop", user_agent="Alice's Firefox")
    ComputingPreferences.objects.create(volunteer=Volunteer.objects.get(user=history.user), duty_cycle=50)

    stand_in = account_delete(user=history.user)

    assert stand_in is not None and stand_in.username.startswith("deleted-") and not stand_in.is_active
    assert not stand_in.has_usable_password() and stand_in.email == ""
    volunteer = Volunteer.objects.get(user=stand_in)
    assert (volunteer.display_name, volunteer.country, volunteer.url) == ("", "", "")
    assert volunteer.public_name() == stand_in.username
    laptop = Device.objects.get(pk=history.laptop.pk)
    assert (laptop.name, laptop.user_agent) == ("", "") and laptop.forgotten_at is not None
    assert not Device.objects.filter(pk=history.phone.pk).exists()  # never computed: nothing to keep
    assert not ComputingPreferences.objects.filter(volunteer=volunteer).exists()
    assert not EmailAddress.objects.filter(email="alice@example.org").exists()


def test_the_deleted_user_appears_nowhere_in_the_database(history: History) -> None:
    volunteer_profile_update(user=history.user, display_name="Alice Liddell", country="", url="")
    researcher_request_create(user=history.user, affiliation="Wonderland U", purpose="Rabbits")
    account_delete(user=history.user)

    dump = StringIO()
    call_command("dumpdata", "--natural-foreign", stdout=dump)
    text = dump.getvalue()
    for trace in ("alice", "Alice Liddell", "alice@example.org", "Wonderland", "laptop-id", "phone-id"):
        assert trace not in text


def test_a_founder_leaving_by_deletion_hands_the_team_on(history: History) -> None:
    team = Team.objects.get(pk=history.team.pk)
    Team.objects.filter(pk=team.pk).update(founder=history.user)
    before = totals(history)

    account_delete(user=history.user)

    team.refresh_from_db()
    assert team.founder == history.other
    assert list(team.members.values_list("user__username", flat=True)) == ["bob"]
    assert totals(history) == before  # the team keeps the credit earned while alice was a member


def test_work_in_progress_is_handed_back_at_once(history: History) -> None:
    work_unit = WorkUnit.objects.get(results=history.results["in_progress"])
    account_delete(user=history.user)
    work_unit.refresh_from_db()
    result = Result.objects.get(pk=history.results["in_progress"].pk)
    assert result.status == "released" and work_unit.wanted == 1


def test_researchers_sessions_tokens_and_requests_go_with_the_account(history: History) -> None:
    User.objects.filter(pk=history.user.pk).update(is_staff=True)
    history.user.refresh_from_db()
    api_token_create(user=history.user)
    account_delete(user=history.user)
    assert not AuthToken.objects.exists() and not ResearcherRequest.objects.exists()


def test_an_owner_of_projects_cannot_delete_the_account(history: History, researcher: User) -> None:
    grant(history.projects[0], researcher, GFLOP)
    before = totals(history)
    with pytest.raises(AccountError, match="projects or datasets"):
        account_delete(user=researcher)
    assert User.objects.filter(pk=researcher.pk).exists() and totals(history) == before


def test_a_user_who_never_contributed_is_simply_deleted(db: None) -> None:
    user = User.objects.create_user("lurker", email="lurker@example.org", password="lurker-pass-123")
    assert account_delete(user=user) is None
    assert not User.objects.filter(username="lurker").exists() and not User.objects.exists()
