"""Root URLconf: the admin (with the staff credit dashboard), the public pages, blobs and the JSON API."""

from django.contrib import admin
from django.urls import include, path, re_path

from config.api import api_not_found
from frontend.throttle import ThrottledAdminAuthenticationForm, throttled_status
from frontend.views import admin_dashboard

admin.site.site_header = "Crowdtrain administration"
admin.site.site_title = "Crowdtrain admin"
admin.site.index_title = "Projects, datasets and volunteers"
# Extends admin/index.html with a link to the dashboard (an app template cannot shadow the admin's own).
admin.site.index_template = "admin/crowdtrain_index.html"
admin.site.login_form = ThrottledAdminAuthenticationForm

urlpatterns = [
    # Ahead of admin.site.urls: the admin's own login view, answering 429 once throttled.
    path("admin/login/", throttled_status(admin.site.login)),
    path("admin/dashboard/", admin.site.admin_view(admin_dashboard), name="admin-dashboard"),
    path("admin/", admin.site.urls),
    path("i18n/", include("django.conf.urls.i18n")),
    path("", include("accounts.urls")),
    path("", include("frontend.urls")),
    path("", include("projects.urls")),
    # Last: whatever else is under /api/ is a JSON 404, not an HTML page.
    re_path(r"^api/(?P<rest>.*)$", api_not_found),
]
