from allauth.account import views as allauth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from accounts import api, views
from frontend.throttle import throttled_status

urlpatterns = [
    # Ahead of allauth's own: the throttled forms' refusals answer 429 (frontend.throttle).
    path("accounts/login/", throttled_status(allauth_views.login), name="account_login"),
    path("accounts/signup/", throttled_status(allauth_views.signup), name="account_signup"),
    path("accounts/", include("allauth.urls")),
    path("account/", views.account, name="account"),
    path("account/profile/", views.profile, name="account-profile"),
    path("account/devices/<int:device_id>/name/", views.device_name, name="account-device-name"),
    path("account/devices/<int:device_id>/forget/", views.device_forget_view, name="account-device-forget"),
    path("account/export/", views.export, name="account-export"),
    path("account/delete/", views.delete, name="account-delete"),
    path("account/researcher/", views.researcher_request, name="account-researcher-request"),
    path("account/tokens/", views.token_create, name="account-token-create"),
    path("account/tokens/revoke/", views.token_revoke, name="account-token-revoke"),
    path("api/auth/login/", api.LoginApi.as_view(), name="api-login"),
    path("api/auth/logout/", api.LogoutApi.as_view(), name="api-logout"),
    path("api/me/", api.MeApi.as_view(), name="api-me"),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
]
