"""workers/teams.py: one team per volunteer, the founder's rights and what happens when the founder goes."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied, ValidationError

from tests.workers.conftest import user
from workers.models import Team, Volunteer
from workers.teams import team_claim, team_create, team_founder_transfer, team_join, team_leave, team_update


def team_of(who: User) -> Team | None:
    return Volunteer.objects.select_related("team").get(user=who).team


def test_the_creator_is_founder_and_first_member(volunteer_user: User) -> None:
    team = team_create(user=volunteer_user, name="  Tensor   Tamers ", description="We train.", country="FR")
    assert team.founder == volunteer_user and team_of(volunteer_user) == team
    assert Team.objects.get().country == "FR"
    assert Volunteer.objects.get(user=volunteer_user).team_joined_at is not None


def test_a_volunteer_is_in_one_team_at_most(volunteer_user: User, other_volunteer: User) -> None:
    first = team_create(user=volunteer_user, name="First")
    second = team_create(user=other_volunteer, name="Second")
    team_join(user=volunteer_user, team_id=second.pk)
    assert team_of(volunteer_user) == second
    assert list(first.members.all()) == [] and second.members.count() == 2
    team_join(user=volunteer_user, team_id=second.pk)  # again: nothing changes
    assert second.members.count() == 2


def test_creating_a_team_leaves_the_one_you_were_in(volunteer_user: User, other_volunteer: User) -> None:
    old = team_create(user=volunteer_user, name="Old")
    team_join(user=other_volunteer, team_id=old.pk)
    new = team_create(user=volunteer_user, name="New")
    old.refresh_from_db()
    assert team_of(volunteer_user) == new and old.founder == other_volunteer


def test_a_founder_who_leaves_hands_the_team_to_the_earliest_member(db: None) -> None:
    founder, early, late = user("founder"), user("early"), user("late")
    team = team_create(user=founder, name="Handed over")
    team_join(user=early, team_id=team.pk)
    team_join(user=late, team_id=team.pk)
    assert team_leave(user=founder, team_id=team.pk)
    team.refresh_from_db()
    assert team.founder == early and team_of(founder) is None


def test_the_last_member_leaving_leaves_a_founderless_team_that_its_next_member_founds(db: None) -> None:
    alone, newcomer = user("alone"), user("newcomer")
    team = team_create(user=alone, name="Quiet")
    team_leave(user=alone, team_id=team.pk)
    team.refresh_from_db()
    assert team.founder is None and Team.objects.filter(pk=team.pk).exists()
    team_join(user=newcomer, team_id=team.pk)
    team.refresh_from_db()
    assert team.founder == newcomer


def test_leaving_a_team_you_are_not_in_changes_nothing(volunteer_user: User, other_volunteer: User) -> None:
    mine = team_create(user=volunteer_user, name="Mine")
    theirs = team_create(user=other_volunteer, name="Theirs")
    assert team_leave(user=volunteer_user, team_id=theirs.pk) is False
    assert team_of(volunteer_user) == mine


def test_only_the_founder_edits_the_page(volunteer_user: User, other_volunteer: User) -> None:
    team = team_create(user=volunteer_user, name="Editable")
    team_join(user=other_volunteer, team_id=team.pk)
    with pytest.raises(PermissionDenied):
        team_update(
            user=other_volunteer, team_id=team.pk, name="Hijacked", description="", url="", country=""
        )
    team_update(
        user=volunteer_user,
        team_id=team.pk,
        name="Edited",
        description="New text",
        url="https://example.org/",
        country="DE",
    )
    team.refresh_from_db()
    assert (team.name, team.description, team.url, team.country) == (
        "Edited",
        "New text",
        "https://example.org/",
        "DE",
    )


def test_team_names_are_unique_ignoring_case(volunteer_user: User, other_volunteer: User) -> None:
    team_create(user=volunteer_user, name="Deep Thought")
    with pytest.raises(ValidationError):
        team_create(user=other_volunteer, name="deep thought")
    assert team_of(other_volunteer) is None  # the failed creation left them where they were
    other = team_create(user=other_volunteer, name="Shallow Thought")
    with pytest.raises(ValidationError):
        team_update(
            user=other_volunteer, team_id=other.pk, name="DEEP THOUGHT", description="", url="", country=""
        )


def test_the_founder_hands_the_role_to_a_member_only(db: None) -> None:
    founder, member, stranger = user("founder"), user("member"), user("stranger")
    team = team_create(user=founder, name="Transfer")
    team_join(user=member, team_id=team.pk)
    with pytest.raises(ValidationError):
        team_founder_transfer(user=founder, team_id=team.pk, to_user_id=stranger.pk)
    with pytest.raises(PermissionDenied):
        team_founder_transfer(user=member, team_id=team.pk, to_user_id=member.pk)
    team_founder_transfer(user=founder, team_id=team.pk, to_user_id=member.pk)
    team.refresh_from_db()
    assert team.founder == member and team_of(founder) == team  # the old founder stays a member


def test_a_member_may_claim_a_founderless_team_and_nobody_else_may(db: None) -> None:
    founder, member, outsider = user("founder"), user("member"), user("outsider")
    team = team_create(user=founder, name="Orphaned")
    team_join(user=member, team_id=team.pk)
    with pytest.raises(PermissionDenied):
        team_claim(user=member, team_id=team.pk)  # it has a founder
    founder.delete()  # the founder's account is deleted: Team.founder becomes null
    team.refresh_from_db()
    assert team.founder is None
    with pytest.raises(PermissionDenied):
        team_claim(user=outsider, team_id=team.pk)
    team_claim(user=member, team_id=team.pk)
    team.refresh_from_db()
    assert team.founder == member


def test_joining_a_team_that_does_not_exist_is_refused(volunteer_user: User) -> None:
    with pytest.raises(Team.DoesNotExist):
        team_join(user=volunteer_user, team_id=987654)
