"""Internationalisation: the French catalogue is complete and compiled, pages and mails follow the chosen
language, and no volunteer-facing text escapes the catalogue."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import polib
import pytest
from django.conf import settings
from django.test import Client

LOCALE = Path(settings.BASE_DIR) / "locale"
CATALOGUE = LOCALE / "fr" / "LC_MESSAGES" / "django.po"


@pytest.fixture(scope="module")
def catalogue() -> polib.POFile:
    return polib.pofile(str(CATALOGUE))


def test_every_string_is_translated(catalogue: polib.POFile) -> None:
    missing = [entry.msgid for entry in catalogue.untranslated_entries()]
    fuzzy = [entry.msgid for entry in catalogue.fuzzy_entries()]
    assert (missing, fuzzy) == ([], [])
    assert len(catalogue.translated_entries()) > 100


def test_the_compiled_catalogue_matches_the_source(catalogue: polib.POFile) -> None:
    compiled = polib.mofile(str(CATALOGUE.with_suffix(".mo")))
    wanted = {(e.msgctxt, e.msgid): (e.msgstr, tuple(sorted(e.msgstr_plural.items()))) for e in catalogue}
    have = {(e.msgctxt, e.msgid): (e.msgstr, tuple(sorted(e.msgstr_plural.items()))) for e in compiled}
    assert have == wanted, "run `make messages` (compilemessages) after editing the .po"


def test_placeholders_survive_translation(catalogue: polib.POFile) -> None:
    """A translation that drops or renames %(name)s or {{ var }} breaks the page at render time."""
    pattern = re.compile(r"%\(\w+\)[sd]|\{\{ ?\w+ ?\}\}|%[sd]")
    broken = [
        e.msgid
        for e in catalogue.translated_entries()
        if sorted(pattern.findall(e.msgid)) != sorted(pattern.findall(e.msgstr or e.msgstr_plural.get(0, "")))
    ]
    assert broken == []


@pytest.mark.django_db
def test_the_browser_language_picks_french() -> None:
    page = Client(headers={"accept-language": "fr-FR,fr;q=0.9"}).get("/")
    assert page.status_code == 200
    assert 'lang="fr"' in page.content.decode()
    assert "Contribuer" in page.content.decode()


@pytest.mark.django_db
def test_the_switcher_keeps_the_choice() -> None:
    client = Client()
    answer = client.post("/i18n/setlang/", {"language": "fr", "next": "/leaderboard/"})
    assert answer.status_code == 302 and answer["Location"] == "/leaderboard/"
    page = client.get("/leaderboard/").content.decode()
    assert 'lang="fr"' in page
    assert (
        'lang="en"'
        in client.post("/i18n/setlang/", {"language": "en", "next": "/"}, follow=True).content.decode()
    )


@pytest.mark.django_db
def test_an_unknown_language_falls_back_to_english() -> None:
    page = Client(headers={"accept-language": "xx"}).get("/").content.decode()
    assert 'lang="en"' in page


# --- what the catalogue is for: every volunteer-facing text goes through it --------------------------

VOLUNTEER_TEMPLATES = sorted(
    list((Path(settings.BASE_DIR) / "frontend" / "templates").glob("*.html"))  # base.html, 403, 404
    + list((Path(settings.BASE_DIR) / "frontend" / "templates" / "frontend").glob("*.html"))
    + list((Path(settings.BASE_DIR) / "accounts" / "templates").rglob("*.html"))
)
# Never translated: the brand, units, and what is code (class names, a command line).
NOT_WORDS = re.compile(
    r"{% comment %}.*?{% endcomment %}|{% blocktranslate.*?{% endblocktranslate %}|{% block \w*class %}.*?{% "
    r"endblock %}|<code>.*?</code>|<script.*?</script>|{%.*?%}|{{.*?}}|\bCrowdtrain\b|\bFLOP\b",
    re.S,
)


@pytest.mark.parametrize("template", VOLUNTEER_TEMPLATES, ids=lambda path: path.name)
def test_volunteer_templates_have_no_text_outside_translate_tags(template: Path) -> None:
    source = NOT_WORDS.sub(" ", template.read_text())
    attributes = re.findall(r'(?:aria-label|title|placeholder|alt)="([^"]*[A-Za-z]{2}[^"]*)"', source)
    text = re.sub(r"<[^>]*>", " ", source)
    assert (attributes, re.findall(r"[A-Za-z]{2,}[^<\n]*", text)) == ([], [])


def test_python_texts_follow_the_active_language() -> None:
    """A form's error, a throttle's refusal and the project page's sentences (projects/curves.py)."""
    from django.utils import translation

    from frontend.throttle import LOGIN_REFUSED
    from projects.curves import Point, compare, duration
    from workers.forms import TeamForm

    points = [Point(seconds=s, samples=s * 10, value=v) for s, v in ((0, 0.1), (20, 0.95))]
    one_cpu = [Point(seconds=s, samples=s * 10, value=v) for s, v in ((0, 0.1), (100, 0.91))]
    with translation.override("fr"):
        assert str(LOGIN_REFUSED).startswith("Trop d’échecs de connexion")
        assert TeamForm(data={"name": "  "}).errors["name"] == ["Ce champ est obligatoire."]
        statement = compare(
            points, one_cpu, metric="test_accuracy", target=0.9, baseline_finished=True
        ).statement
        assert statement.startswith(
            "La plateforme a été 5,0× plus rapide qu’un CPU pour atteindre l’objectif"
        )
        assert "précision de test de 90,0\u00a0%" in statement and duration(200000) == "2 j 7 h"
    assert str(LOGIN_REFUSED).startswith("Too many failed log-ins")


@pytest.mark.django_db
def test_the_project_page_and_its_scripts_texts_are_french(mlp_project: Any) -> None:
    client = Client(headers={"accept-language": "fr"})
    html = client.get(f"/projects/{mlp_project.pk}/").content.decode()
    assert ">En cours</span>" in html and "Métriques de test par version" in html
    found = re.search(r'id="project-text" type="application/json">(.*?)</script>', html, re.S)
    assert found is not None
    text = json.loads(found[1])
    assert text["statuses"]["running"] == "En cours" and text["one_cpu"] == "un CPU (serveur)"
    # The baseline's reason is stored in English and shown in the reader's language when it is a known one.
    live = client.get(f"/projects/{mlp_project.pk}/live/").json()
    assert live["comparison"]["statement"] == "La référence sur un CPU est désactivée sur ce serveur."


@pytest.mark.django_db
def test_allauth_mails_are_in_the_language_of_the_request(mailoutbox: list[Any], settings: Any) -> None:
    """The site overrides no mail template: allauth's own, from its French catalogue, in the request's
    language."""
    from allauth.account.models import EmailAddress
    from django.contrib.auth.models import User
    from django.core.cache import cache

    settings.RATELIMIT_CACHE_PREFIX = f"rl-i18n-{uuid.uuid4().hex}:"
    cache.clear()
    user = User.objects.create_user("amelie", password="amelie-pass-123")
    EmailAddress.objects.create(user=user, email="amelie@example.org", verified=True, primary=True)
    client = Client(headers={"accept-language": "fr"})
    assert client.post("/accounts/password/reset/", {"email": "amelie@example.org"}).status_code == 302
    (message,) = mailoutbox
    assert message.subject == "[Crowdtrain] E-mail de réinitialisation de mot de passe"
    assert "Vous recevez cet e-mail" in str(message.body) and "/accounts/password/reset/key/" in str(
        message.body
    )


@pytest.mark.django_db
def test_error_pages_are_the_sites_own_and_translated(volunteer_user: Any, other_volunteer: Any) -> None:
    from workers.teams import team_create

    team = team_create(user=other_volunteer, name="Les Gradients")
    client = Client(headers={"accept-language": "fr"})
    missing = client.get("/teams/999999/")
    assert missing.status_code == 404 and "Page introuvable" in missing.content.decode()
    client.force_login(volunteer_user)
    refused = client.get(f"/teams/{team.pk}/edit/")
    assert refused.status_code == 403
    assert "Seul le fondateur de l’équipe peut modifier sa page." in refused.content.decode()


def test_the_contribute_pages_live_recent_average_reads_as_its_template() -> None:
    """contribute.js writes #recent-average with these after each credit: the template's blocktranslate
    msgid, and the separators the `credit` filter uses in the page's language."""
    from django.utils import translation

    from frontend.contribute_page import contribute_strings

    with translation.override("fr"):
        strings = contribute_strings()
    assert strings["recent_average"] == "%(credit)s crédits/jour"
    assert (strings["decimal_separator"], strings["thousand_separator"]) == (",", "\xa0")
    assert contribute_strings()["recent_average"] == "%(credit)s credit/day"
