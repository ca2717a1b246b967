"""API tokens and the caller's identity: POST /api/auth/login/ (HTTP Basic, throttled as the site's login),
POST /api/auth/logout/, GET /api/me/."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from drf_spectacular.utils import extend_schema, inline_serializer
from knox.auth import TokenAuthentication
from rest_framework import serializers, status
from rest_framework.authentication import BasicAuthentication
from rest_framework.exceptions import AuthenticationFailed, PermissionDenied, Throttled
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.selectors import user_is_researcher
from accounts.services import AccountError, api_token_create
from config.api import DETAIL
from frontend.throttle import LOGIN_REFUSED, login_failed, login_refused


class ThrottledBasicAuthentication(BasicAuthentication):
    """HTTP Basic counted by the same throttle as the site's and the admin's logins (frontend/throttle.py)."""

    def authenticate_credentials(self, userid: str, password: str, request: Any = None) -> tuple[User, None]:
        http_request = getattr(request, "_request", request)
        if http_request is not None and login_refused(http_request, username=userid):
            raise Throttled(detail=LOGIN_REFUSED)
        try:
            return super().authenticate_credentials(userid, password, request)
        except AuthenticationFailed:
            if http_request is not None:
                login_failed(http_request, username=userid)
            raise


class TokenSerializer(serializers.Serializer):
    token = serializers.CharField()
    expiry = serializers.DateTimeField(allow_null=True)


class LoginApi(APIView):
    authentication_classes = [ThrottledBasicAuthentication]
    permission_classes = [IsAuthenticated]

    @extend_schema(
        operation_id="auth_login",
        request=None,
        responses={200: TokenSerializer, 401: DETAIL, 403: DETAIL, 429: DETAIL},
        description="HTTP Basic (username:password) -> a new API token. Approved researchers only.",
    )
    def post(self, request: Request) -> Response:
        try:
            instance, token = api_token_create(user=request.user)  # type: ignore[arg-type]
        except AccountError as exc:
            raise PermissionDenied(str(exc)) from exc
        return Response(TokenSerializer({"token": token, "expiry": instance.expiry}).data)


class LogoutApi(APIView):
    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated]

    @extend_schema(operation_id="auth_logout", request=None, responses={204: None, 401: DETAIL})
    def post(self, request: Request) -> Response:
        request.auth.delete()
        return Response(status=status.HTTP_204_NO_CONTENT)


class MeApi(APIView):
    permission_classes = [IsAuthenticated]

    @extend_schema(
        operation_id="me",
        responses={
            200: inline_serializer(
                "Me", {"username": serializers.CharField(), "is_researcher": serializers.BooleanField()}
            ),
            401: DETAIL,
            403: DETAIL,
        },
    )
    def get(self, request: Request) -> Response:
        user = request.user
        return Response({"username": user.get_username(), "is_researcher": user_is_researcher(user=user)})
