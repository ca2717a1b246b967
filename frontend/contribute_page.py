"""What the Contribute page shows before its script runs: the volunteer's credit today and recent average,
and every text its script (contribute.js) may show, translated here (the page's #contribute-strings).

Texts take %(name)s placeholders, filled in by the script."""

from __future__ import annotations

from typing import Any

from django.utils import timezone
from django.utils.formats import get_format
from django.utils.translation import gettext as _

from workers.models import Volunteer
from workers.selectors import credit_since


def contribute_context(*, volunteer: Volunteer) -> dict[str, Any]:
    now = timezone.now()
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)  # UTC, as the ledger
    return {
        "volunteer": volunteer,
        "credit_today": credit_since(volunteer_id=volunteer.pk, since=midnight),
        "recent_average": volunteer.recent_credit(now=now),
        "strings": contribute_strings(),
    }


def contribute_strings() -> dict[str, str]:
    """Called per request: gettext in the request's language."""
    return {
        **_status_strings(),
        **_pause_strings(),
        **_preference_strings(),
        **_log_strings(),
        **_credit_strings(),
    }


def _credit_strings() -> dict[str, str]:
    """The recent average as the template shows it (the msgid of its blocktranslate), and the separators
    the `credit` filter uses in this language, for the script's copy of that filter."""
    return {
        "recent_average": _("%(credit)s credit/day"),
        "decimal_separator": str(get_format("DECIMAL_SEPARATOR")),
        "thousand_separator": str(get_format("THOUSAND_SEPARATOR")),
    }


def _status_strings() -> dict[str, str]:
    return {
        "status_starting": _("Starting the engine (benchmarking your device)…"),
        "status_connecting": _("Connecting…"),
        "status_connected": _("Connected, asking for work…"),
        "status_training": _("Training %(project)s: %(samples)s samples…%(next)s"),
        "next_ready": _(" (next one ready)"),
        "status_waiting": _("Waiting for work…"),
        "status_reconnecting": _("%(why)s, retrying in %(seconds)s s…"),
        "throttled": _("Too many connections"),
        "connection_lost": _("Connection lost"),
        "status_unsupported": _("This browser cannot run the engine."),
        "status_stopped": _("Stopped."),
        "title_training": _("▶ Training %(project)s — Crowdtrain"),
        "title_paused": _("⏸ Paused (%(reason)s) — Crowdtrain"),
        "title_waiting": _("⏳ Waiting for work — Crowdtrain"),
        "speed_note": _("%(backend)s, measured in this browser"),
        "why_choice": _("your choice"),
        "why_share": _("its turn by resource share"),
        "why_only": _("the only project with work for you"),
        "stage_of": _("serving stage %(stage)s of %(stages)s of its model"),
    }


def _pause_strings() -> dict[str, str]:
    """For each reason to pause (the page's own, the duty cycle's, and the server's idle_reasons): the status
    line, the explanation and the tab title's word."""
    texts = {
        "hidden": (_("Paused: this tab is hidden."), _("It resumes when you come back."), _("hidden")),
        "battery": (
            _("Paused: on battery."),
            _("It resumes when the device is plugged in."),
            _("battery"),
        ),
        "battery_low": (
            _("Paused: the battery is low."),
            _("It resumes when the battery is charged again."),
            _("battery"),
        ),
        "active": (
            _("Paused while you use the page."),
            _("It resumes a few seconds after your last key press or mouse move."),
            _("typing"),
        ),
        "throttle": (
            _("Resting: using at most %(percent)s %% of the time."),
            _("Your preferences limit the time spent computing; the next work unit starts after this rest."),
            _("throttle"),
        ),
        "no_work": (
            _("Waiting for work: none of your projects has any right now."),
            _("Training starts again as soon as there is work."),
            _("no work"),
        ),
        "download_limit": (
            _("Paused: today's download limit is reached."),
            _("Your preferences allow %(max_download_mb_per_day)s MB a day on this device."),
            _("download limit"),
        ),
        "too_large": (
            _("Waiting: no work unit fits this device."),
            _("The work there is needs more memory or download than your limits or this device allow."),
            _("too large"),
        ),
        "backoff": (
            _("Paused after invalid results."),
            _("New work comes again after a pause that doubles with each invalid result."),
            _("back-off"),
        ),
    }
    strings: dict[str, str] = {}
    for reason, (status, explanation, word) in texts.items():
        strings.update({f"status_{reason}": status, f"pause_{reason}": explanation, f"short_{reason}": word})
    return strings


def _preference_strings() -> dict[str, str]:
    return {
        "pref_full": _("uses all the time it gets"),
        "pref_duty": _("at most %(percent)s %% of the time"),
        "pref_hidden": _("pauses while hidden"),
        "pref_battery": _("pauses on battery"),
        "pref_battery_min": _("pauses below %(percent)s %% battery"),
        "pref_active": _("pauses while you use the page"),
        "pref_projects_only": _("only the projects you chose"),
        "pref_projects_except": _("not the projects you left out"),
        "pref_work_unit": _("work units up to %(mb)s MB"),
        "pref_download": _("at most %(mb)s MB a day"),
        "source_default": _("(the usual preferences)"),
        "source_volunteer": _("(your defaults)"),
        "source_device": _("(this device's own)"),
    }


def _log_strings() -> dict[str, str]:
    return {
        "log_connected": _("connected as %(username)s"),
        "log_preferences": _("preferences updated"),
        "log_paused": _("paused (%(reason)s)"),
        "log_resumed": _("resumed"),
        "log_released": _("gave back work units %(ids)s, not started"),
        "log_cancelled": _("work unit %(id)s cancelled (%(reason)s)"),
        "log_ring_failed": _("work unit %(id)s given back: its input did not come (%(error)s)"),
        "log_uploaded": _("work unit %(id)s uploaded (%(status)s)"),
        "log_not_used": _("work unit %(id)s not used: %(reason)s"),
        "log_validated": _("work unit %(id)s validated: +%(credit)s"),
        "log_verdict": _("work unit %(id)s %(status)s: %(reason)s"),
        "log_result": _(
            "work unit %(id)s: %(samples)s samples, loss %(loss)s, %(compute)s ms compute, "
            "%(download)s ms download"
        ),
        "log_failed": _("work unit %(id)s failed: %(error)s"),
        "log_server_error": _("server error %(code)s: %(message)s"),
        "log_unknown_type": _("unknown message type %(type)s"),
        "log_bad_message": _("bad server message: %(error)s"),
        "log_engine_ready": _("engine ready on %(backend)s (%(gflops)s GFLOP/s)"),
        "log_engine_failed": _("could not start the engine: %(error)s"),
        "log_engine_crashed": _("engine crashed: %(error)s"),
        "log_stopped": _("stopped"),
        "no_reason": _("no reason"),
        "accepted": _("accepted"),
    }
