"""What every REST API view shares (projects/api.py, accounts/api.py): the error shapes the schema
documents, and the pagination of every list."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, inline_serializer
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import PageNumberPagination
from rest_framework.request import Request


class ErrorSerializer(serializers.Serializer):
    detail = serializers.CharField()


DETAIL = OpenApiResponse(ErrorSerializer, description='{"detail": "<why>"}')
FIELD_ERRORS = OpenApiResponse(
    OpenApiTypes.OBJECT, description='{"<field>": ["<message>", ...]} or {"detail": "<why>"}'
)
# Any route may answer these: no or a bad token, someone else's object, a throttle.
COMMON = {401: DETAIL, 403: DETAIL, 404: DETAIL}


class Pages(PageNumberPagination):
    page_size = 50
    max_page_size = 50

    def get_page_number(self, request: Request, paginator: Any) -> int | str:
        text = request.query_params.get(self.page_query_param)
        if text is None or text == "last":
            return super().get_page_number(request, paginator)
        if not (text.isdigit() and 0 < len(text) <= 9 and int(text) > 0):
            raise ValidationError({"page": ["A page number: a positive integer."]})
        return int(text)


def paginated(name: str, item: serializers.Serializer) -> serializers.Serializer:
    """The schema of one page of a list: {"count", "next", "previous", "results"}."""
    return inline_serializer(
        name,
        {
            "count": serializers.IntegerField(),
            "next": serializers.URLField(allow_null=True),
            "previous": serializers.URLField(allow_null=True),
            "results": item,
        },
    )


@csrf_exempt  # a POST to a mistyped URL is a 404 whatever the cookies, never the CSRF failure page
def api_not_found(request: HttpRequest, rest: str = "") -> JsonResponse:
    """Any /api/ URL no route matches (a malformed id included) answers JSON, as every API response does."""
    return JsonResponse({"detail": "No such API endpoint (see /api/docs/)."}, status=404)
