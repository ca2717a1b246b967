import os
import resource

from django.core.asgi import get_asgi_application


def open_files_raised() -> int:
    """Every volunteer's WebSocket is a file descriptor: the soft limit (often 1,024, or the 20,000 that
    capped one daphne at 19,472 volunteers) goes up to the hard one, which only the operator can raise."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1_048_576
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            return soft
        return wanted
    return soft


open_files_raised()
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_asgi_app = get_asgi_application()

from channels.layers import get_channel_layer  # noqa: E402  (needs Django set up first)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from config.admission import AdmissionMiddleware  # noqa: E402
from config.websocket_auth import PooledAuthMiddlewareStack  # noqa: E402
from projects.blob_server import with_blobs  # noqa: E402
from workers.presence import groups_purge_at_start  # noqa: E402
from workers.routing import websocket_urlpatterns  # noqa: E402

groups_purge_at_start(get_channel_layer())

application = ProtocolTypeRouter(
    {
        "http": with_blobs(django_asgi_app),
        "websocket": AdmissionMiddleware(
            AllowedHostsOriginValidator(PooledAuthMiddlewareStack(URLRouter(websocket_urlpatterns)))
        ),
    }
)
