"""drf-spectacular: the throttled HTTP Basic login is HTTP Basic in the schema."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ThrottledBasicScheme(OpenApiAuthenticationExtension):
    target_class = "accounts.api.ThrottledBasicAuthentication"
    name = "basicAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "basic"}
