from django.urls import path

from workers.consumers import VolunteerConsumer

websocket_urlpatterns = [path("ws/volunteer/", VolunteerConsumer.as_asgi())]
