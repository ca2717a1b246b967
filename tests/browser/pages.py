"""The Contribute page as Django renders it (base.html, the template, its translated strings), for the
database-free browser tests that serve it from the static server against a scripted WebSocket server."""

from __future__ import annotations

from types import SimpleNamespace

from django.template.loader import render_to_string

from frontend.contribute_page import contribute_strings


def contribute_html(socket_url: str, *, credit_today: int = 0) -> str:
    volunteer = SimpleNamespace(total_flops=0, expavg_credit=0.0)
    context = {
        "volunteer": volunteer,
        "credit_today": credit_today,
        "recent_average": 0.0,
        "strings": contribute_strings(),
    }
    html = render_to_string("frontend/contribute.html", context)
    socket_path = 'data-socket-path="/ws/volunteer/"'
    assert html.count(socket_path) == 1
    return html.replace(socket_path, f'data-socket-url="{socket_url}"')
