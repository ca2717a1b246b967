from django.contrib.auth import views as auth_views
from django.urls import path

from frontend import views
from frontend.throttle import ThrottledAuthenticationForm, throttled_status

login_view = auth_views.LoginView.as_view(
    form_class=ThrottledAuthenticationForm, redirect_authenticated_user=True
)

urlpatterns = [
    path("", views.home, name="home"),
    path("signup/", views.signup, name="signup"),
    path("login/", throttled_status(login_view), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("leaderboard/", views.leaderboard_page, name="leaderboard"),
    path("contribute/", views.contribute, name="contribute"),
]
