"""Teams: create, join, leave, the founder's page and the hand-over of the founder's role.

The rules, as BOINC's where BOINC has one:
- A volunteer is in at most one team (Volunteer.team); joining another team leaves the first.
- A team's credit is what its members earned while members (workers.services.credit_grant): joining brings
  none of the newcomer's past credit, leaving takes nothing away.
- The founder edits the team's page (name, description, URL, country) and may hand the role to a member.
- Our decision where BOINC leaves the founder in place after they quit: a founder who leaves hands the team
  to the member who joined it first. With nobody left the team stays, founderless, and whoever joins it next
  becomes its founder. A team whose founder's account was deleted is founderless too, and any member may
  take the role (team_claim), so no team with members stays uneditable.

Locks: a volunteer's row before any team's, teams in id order (as credit_grant and credit_lock).
"""

from __future__ import annotations

from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone
from django.utils.translation import gettext as _

from workers.models import Team, Volunteer
from workers.services import volunteer_ensure


def team_create(*, user: User, name: str, description: str = "", url: str = "", country: str = "") -> Team:
    """A new team with `user` as its founder and first member (leaving any team they were in)."""
    volunteer_ensure(user=user)
    try:
        with transaction.atomic():
            volunteer = _locked_volunteer(user=user)
            _leave(volunteer=volunteer)
            team = Team.objects.create(
                name=name, description=description, url=url, country=country, founder=user
            )
            _enter(volunteer=volunteer, team=team)
    except IntegrityError as exc:  # a team of that name was created since the form checked
        raise ValidationError(_("A team with this name already exists."), code="name_taken") from exc
    return team


def team_join(*, user: User, team_id: int) -> Team:
    volunteer_ensure(user=user)
    with transaction.atomic():
        volunteer = _locked_volunteer(user=user)
        teams = _locked_teams(team_ids=[team_id, volunteer.team_id])
        if team_id not in teams:
            raise Team.DoesNotExist
        if volunteer.team_id != team_id:
            _leave(volunteer=volunteer, team=teams.get(volunteer.team_id or 0))
            _enter(volunteer=volunteer, team=teams[team_id])
        return teams[team_id]


def team_leave(*, user: User, team_id: int) -> bool:
    """Leave team `team_id`; False if the volunteer is not in it (a stale page's button)."""
    volunteer_ensure(user=user)
    with transaction.atomic():
        volunteer = _locked_volunteer(user=user)
        if volunteer.team_id != team_id:
            return False
        _leave(volunteer=volunteer)
    return True


def team_update(*, user: User, team_id: int, name: str, description: str, url: str, country: str) -> Team:
    """The founder's edit of the team's page."""
    try:
        with transaction.atomic():
            team = _founded(user=user, team_id=team_id)
            team.name, team.description, team.url, team.country = name, description, url, country
            team.save(update_fields=["name", "description", "url", "country"])
    except IntegrityError as exc:
        raise ValidationError(_("A team with this name already exists."), code="name_taken") from exc
    return team


def team_founder_transfer(*, user: User, team_id: int, to_user_id: int) -> Team:
    """The founder hands the role to another member of the team."""
    with transaction.atomic():
        member = Volunteer.objects.select_for_update(no_key=True).filter(user_id=to_user_id).first()
        team = _founded(user=user, team_id=team_id)
        if member is None or member.team_id != team.pk:
            raise ValidationError(_("The new founder must be a member of the team."), code="not_member")
        team.founder_id = to_user_id
        team.save(update_fields=["founder"])
    return team


def team_claim(*, user: User, team_id: int) -> Team:
    """A member takes the founder's role of a team that has no founder."""
    volunteer_ensure(user=user)
    with transaction.atomic():
        volunteer = _locked_volunteer(user=user)
        team = _locked_teams(team_ids=[team_id])[team_id]
        if volunteer.team_id != team.pk or team.founder_id is not None:
            raise PermissionDenied(_("Only a member of a team without a founder can become its founder."))
        team.founder = user
        team.save(update_fields=["founder"])
    return team


def _locked_volunteer(*, user: User) -> Volunteer:
    return Volunteer.objects.select_for_update(no_key=True).get(user=user)


def _locked_teams(*, team_ids: list[int | None]) -> dict[int, Team]:
    """The teams that exist among `team_ids`, locked in id order."""
    wanted = {team_id for team_id in team_ids if team_id is not None}
    teams = Team.objects.select_for_update(no_key=True).filter(pk__in=wanted).order_by("pk")
    return {team.pk: team for team in teams}


def _founded(*, user: User, team_id: int) -> Team:
    team = Team.objects.select_for_update(no_key=True).get(pk=team_id)
    if team.founder_id != user.pk:
        raise PermissionDenied(_("Only the team's founder can do this."))
    return team


def _enter(*, volunteer: Volunteer, team: Team) -> None:
    volunteer.team, volunteer.team_joined_at = team, timezone.now()
    volunteer.save(update_fields=["team", "team_joined_at"])
    if team.founder_id is None:
        team.founder_id = volunteer.user_id
        team.save(update_fields=["founder"])


def _leave(*, volunteer: Volunteer, team: Team | None = None) -> None:
    """Out of the team (locked by the caller, or here); a founder hands it to the earliest member left."""
    if volunteer.team_id is None:
        return
    team = team or _locked_teams(team_ids=[volunteer.team_id])[volunteer.team_id]
    volunteer.team, volunteer.team_joined_at = None, None
    volunteer.save(update_fields=["team", "team_joined_at"])
    if team.founder_id == volunteer.user_id:
        # Members from before join times were kept count as the earliest.
        earliest = (F("team_joined_at").asc(nulls_first=True), "pk")
        successor = team.members.order_by(*earliest).values_list("user_id", flat=True).first()
        team.founder_id = successor
        team.save(update_fields=["founder"])
