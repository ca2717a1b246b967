"""Crowdtrain settings: everything comes from the environment, with safe local defaults.

Local (no env): SQLite in var/, a bundled redis-server started by `manage.py runplatform`.
Production: DJANGO_ENV=production plus DATABASE_URL, REDIS_URL, DJANGO_SECRET_KEY, DJANGO_ALLOWED_HOSTS.
"""

import os
from datetime import timedelta
from pathlib import Path

import dj_database_url
from celery.schedules import crontab
from django.conf import global_settings

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("CROWDTRAIN_VAR_DIR", BASE_DIR / "var"))


def env_bool(name: str, default: bool) -> bool:
    return os.environ.get(name, str(default)).lower() in {"1", "true", "yes", "on"}


def env_list(name: str, default: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


PRODUCTION = os.environ.get("DJANGO_ENV", "local") == "production"
DEBUG = env_bool("DJANGO_DEBUG", not PRODUCTION)
# The local default is not a secret: production refuses to start without a real key.
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "" if PRODUCTION else "local-dev-only-not-secret")
if not SECRET_KEY:
    raise RuntimeError("DJANGO_SECRET_KEY must be set when DJANGO_ENV=production")
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", "" if PRODUCTION else "localhost,127.0.0.1,[::1]")
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS", "")

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "django_countries",  # country names, translated
    "rest_framework",
    "channels",
    "projects",
    "workers",
    "frontend",
    "config",  # management commands: runplatform, ensure_admin
    "django_ratelimit",  # its system checks catch a cache that cannot count (see SILENCED_SYSTEM_CHECKS)
    "accounts",  # ahead of allauth: its templates restyle allauth's pages
    "uploads",
    "allauth",
    "allauth.account",
    "knox",
    "drf_spectacular",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    # After sessions (a chosen language is kept there and in a cookie), before common (redirects).
    "django.middleware.locale.LocaleMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "allauth.account.middleware.AccountMiddleware",
]

ROOT_URLCONF = "config.urls"
ASGI_APPLICATION = "config.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL", f"sqlite:///{VAR_DIR / 'db.sqlite3'}"),
        conn_max_age=int(os.environ.get("DATABASE_CONN_MAX_AGE", "0")),
    )
}
if DATABASES["default"]["ENGINE"].endswith("postgresql") and env_bool("DATABASE_POOL", True):
    # daphne runs every consumer's queries in short calls, and Celery a task per result: without a pool
    # each one opened (and Postgres forked) a fresh connection. Django's pool needs CONN_MAX_AGE 0.
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    DATABASES["default"]["OPTIONS"] = {
        "pool": {"min_size": 1, "max_size": int(os.environ.get("DATABASE_POOL_SIZE", 8)), "timeout": 30}
    }
elif DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # Several processes (daphne, worker, beat) share one file: wait for locks instead of failing.
    DATABASES["default"]["OPTIONS"] = {"timeout": 30, "transaction_mode": "IMMEDIATE"}
    Path(DATABASES["default"]["NAME"]).parent.mkdir(parents=True, exist_ok=True)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Django's own list (PBKDF2 first) unless the operator names others, Argon2 first, say. The test suite names
# MD5, whose hashes cost nothing (PBKDF2 took 0.34 s a hash, most of a database test's setup); new passwords
# are hashed with the first, and production refuses MD5 there.
PASSWORD_HASHERS = env_list("DJANGO_PASSWORD_HASHERS", "") or global_settings.PASSWORD_HASHERS
if PRODUCTION and PASSWORD_HASHERS[0].endswith("MD5PasswordHasher"):
    raise RuntimeError("DJANGO_PASSWORD_HASHERS: MD5 cannot hash new passwords when DJANGO_ENV=production")
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "account_login"
AUTHENTICATION_BACKENDS = [
    "django.contrib.auth.backends.ModelBackend",
    "allauth.account.auth_backends.AuthenticationBackend",
]
LOGIN_REDIRECT_URL = "contribute"
LOGOUT_REDIRECT_URL = "home"

LANGUAGE_CODE = "en"
# Volunteer-facing pages and e-mails; the admin and researchers' tools stay in English where untranslated.
LANGUAGES = [("en", "English"), ("fr", "Français")]
LOCALE_PATHS = [BASE_DIR / "locale"]
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = Path(os.environ.get("STATIC_ROOT", VAR_DIR / "static"))
STATICFILES_DIRS = [("vendor", BASE_DIR / "frontend" / "vendor")]
MEDIA_ROOT = Path(os.environ.get("MEDIA_ROOT", VAR_DIR / "media"))
BLOB_ROOT = MEDIA_ROOT / "blobs"
# The daily BOINC-style statistics dumps (workers/stats.py), public at /stats/.
STATS_ROOT = Path(os.environ.get("STATS_ROOT", VAR_DIR / "stats"))
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": (
            "whitenoise.storage.CompressedManifestStaticFilesStorage"
            if PRODUCTION
            else "django.contrib.staticfiles.storage.StaticFilesStorage"
        )
    },
    # Blobs (weights, dataset shards, updates): files under BLOB_ROOT, or an S3-compatible bucket shared by
    # web and worker processes on several machines (django-storages; projects/blob_store.py) when
    # CROWDTRAIN_BLOB_BUCKET is set. Credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.
    "blobs": (
        {
            "BACKEND": "storages.backends.s3.S3Storage",
            "OPTIONS": {
                "bucket_name": os.environ["CROWDTRAIN_BLOB_BUCKET"],
                "location": os.environ.get("CROWDTRAIN_BLOB_PREFIX", "blobs"),
                "endpoint_url": os.environ.get("AWS_S3_ENDPOINT_URL") or None,  # MinIO, Ceph, R2...
                "region_name": os.environ.get("AWS_S3_REGION_NAME") or None,
                "addressing_style": os.environ.get("AWS_S3_ADDRESSING_STYLE") or None,  # "path" for MinIO
                "file_overwrite": True,  # content-addressed: the same name is the same bytes
                "default_acl": None,  # private: daphne serves blobs and decides who may read them
                "max_memory_size": 8 * 2**20,  # a blob being served spills to a temporary file past this
            },
        }
        if os.environ.get("CROWDTRAIN_BLOB_BUCKET")
        else {"BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": BLOB_ROOT}}
    ),
}

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
# Every web process re-adds its live connections to their groups and stamps their devices' last_seen this
# often (workers/presence.py). A member or device not refreshed for SOCKET_STALE_SECONDS belonged to a
# connection that died uncleanly: the layer drops the member (group_expiry), the beat sweep the device.
SOCKET_HEARTBEAT_SECONDS = int(os.environ.get("CROWDTRAIN_SOCKET_HEARTBEAT_SECONDS", 30))
SOCKET_STALE_SECONDS = 4 * SOCKET_HEARTBEAT_SECONDS
# WebSocket connections a web process admits at once, from handshake to welcome (config/admission.py): more
# wait in line for up to SOCKET_ADMISSION_WAIT_SECONDS, then are closed with 4503 (try again later) and come
# back after the browser's jittered back-off. The wait must stay well below daphne's handshake limit (30 s).
SOCKET_ADMISSIONS = int(os.environ.get("CROWDTRAIN_SOCKET_ADMISSIONS", 256))
SOCKET_ADMISSION_WAIT_SECONDS = float(os.environ.get("CROWDTRAIN_SOCKET_ADMISSION_WAIT_SECONDS", 20))
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "config.channel_layer.BoundedRedisChannelLayer",
        "CONFIG": {
            "hosts": [REDIS_URL],
            "capacity": 1000,
            "expiry": 30,
            "group_expiry": SOCKET_STALE_SECONDS,
        },
    }
}
# Throttling counters (e.g. WebSocket connects) must be shared by every process: Redis, not local memory.
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "OPTIONS": {
            "pool_class": "config.channel_layer.SharedCachePool"
        },  # one pool per process (why: there)
    }
}
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", REDIS_URL)
CELERY_RESULT_BACKEND = None
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Validations and the spot checks' recomputations get their own queue, so a backlog of them never delays
# the short tasks that close rounds and feed the next one: workers take from both queues in turn.
CELERY_TASK_ROUTES = {
    "projects.tasks.validate_result": {"queue": "validation"},
    "projects.tasks.validate_results": {"queue": "validation"},
    "projects.tasks.compute_reference": {"queue": "validation"},
    # The one-CPU time-to-accuracy baseline (minutes of training): a worker of its own, niced, so it never
    # delays validation or a round (runplatform's baseline_args).
    "projects.tasks.train_baseline": {"queue": "baseline"},
}
CELERY_BEAT_SCHEDULE = {
    "feed-work-units": {"task": "projects.tasks.feed_work_units", "schedule": 5.0},
    "transition": {"task": "projects.tasks.transition", "schedule": 5.0},
    "evaluate-projects": {"task": "projects.tasks.evaluate_projects", "schedule": 15.0},
    "collect-storage": {
        "task": "projects.tasks.collect_storage",
        "schedule": float(os.environ.get("CROWDTRAIN_STORAGE_SWEEP_SECONDS", 60)),
    },
    "queue-baselines": {"task": "projects.tasks.queue_baselines", "schedule": 60.0},
    # Pipeline volunteers moved to the stage that is the bottleneck or lost its own (projects/swarms.py).
    "rebalance-pipelines": {"task": "projects.tasks.rebalance_pipelines", "schedule": 10.0},
    # Devices whose connection died without a goodbye (their process killed): disconnected, work released.
    "sweep-devices": {"task": "workers.tasks.sweep_devices", "schedule": float(SOCKET_HEARTBEAT_SECONDS)},
    # BOINC projects dump their statistics once a day; the minute is arbitrary (off the hour's peak).
    "export-stats": {
        "task": "workers.tasks.export_stats",
        "schedule": crontab(minute=17, hour=int(os.environ.get("CROWDTRAIN_STATS_HOUR", 3))),
    },
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "knox.auth.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.PageNumberPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
# Researchers' API tokens (django-rest-knox): stored hashed, shown once, revocable from /account/.
REST_KNOX = {
    "TOKEN_TTL": timedelta(days=int(os.environ.get("CROWDTRAIN_API_TOKEN_DAYS", 90))),
    "TOKEN_PREFIX": "ct_",
    "TOKEN_LIMIT_PER_USER": 20,
    "AUTO_REFRESH": False,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Crowdtrain API",
    "DESCRIPTION": "Researchers' REST API: projects, datasets (resumable uploads), versions, metrics and "
    "checkpoints. Authenticate with `Authorization: Token <token>` (POST /api/auth/login/ or /account/).",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI from npm (scripts/vendor_static.py), served by us: no CDN.
    "SWAGGER_UI_DIST": "/static/vendor/swagger-ui",
    "SWAGGER_UI_FAVICON_HREF": "/static/vendor/swagger-ui/favicon-32x32.png",
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {"CodecEnum": "projects.models.Project.Codec"},
}

# Accounts (django-allauth): a username and a password; an e-mail address is optional (password resets).
ACCOUNT_LOGIN_METHODS = {"username"}
ACCOUNT_SIGNUP_FIELDS = ["username*", "email", "password1*", "password2*"]
# An address given is mailed a link that verifies it; the account works before that (resets need it).
ACCOUNT_EMAIL_VERIFICATION = "optional"
# One address per account, changed rather than added to (the new one is verified before it replaces it).
ACCOUNT_CHANGE_EMAIL = True
ACCOUNT_EMAIL_SUBJECT_PREFIX = "[Crowdtrain] "
# The scheme of the links in mails (verification, reset): the site is HTTPS-only in production.
ACCOUNT_DEFAULT_HTTP_PROTOCOL = "https" if PRODUCTION else "http"
ACCOUNT_FORMS = {"login": "accounts.forms.ThrottledLoginForm", "signup": "accounts.forms.ThrottledSignupForm"}
# Logins and sign-ups are throttled by frontend/throttle.py's counters (shared with the admin's login, the
# 429 of its throttled_status); allauth's own limits on them would refuse the simulated volunteers that all
# sign in from 127.0.0.1. allauth limits the rest (a 429, accounts/templates/429.html): reset mails per
# address and per e-mail, following reset links, verification mails (one per 3 minutes), password changes.
ACCOUNT_RATE_LIMITS = {
    "login": None,
    "login_failed": None,
    "signup": None,
    "reset_password": "20/m/ip,5/m/key",
    "reset_password_from_key": "20/m/ip",
    "confirm_email": "1/3m/key",
    "change_password": "5/m/user",
    "manage_email": "10/m/user",
}
ACCOUNT_LOGOUT_REDIRECT_URL = "home"
ALLAUTH_TRUSTED_PROXY_COUNT = int(os.environ.get("CROWDTRAIN_TRUSTED_PROXIES", 0))
# Mail (password resets, address confirmation): printed to the console locally, SMTP in production.
EMAIL_BACKEND = os.environ.get(
    "DJANGO_EMAIL_BACKEND",
    f"django.core.mail.backends.{'smtp' if PRODUCTION else 'console'}.EmailBackend",
)
EMAIL_HOST = os.environ.get("DJANGO_EMAIL_HOST", "localhost")
EMAIL_PORT = int(os.environ.get("DJANGO_EMAIL_PORT", 587))
EMAIL_HOST_USER = os.environ.get("DJANGO_EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = os.environ.get("DJANGO_EMAIL_HOST_PASSWORD", "")
# STARTTLS (port 587), unless implicit TLS (port 465) is asked for: at most one of the two.
EMAIL_USE_SSL = env_bool("DJANGO_EMAIL_USE_SSL", False)
EMAIL_USE_TLS = env_bool("DJANGO_EMAIL_USE_TLS", not EMAIL_USE_SSL)
# Mail is sent while the page waits (sign-up, reset): a dead SMTP server costs seconds, not a hung worker.
EMAIL_TIMEOUT = int(os.environ.get("DJANGO_EMAIL_TIMEOUT", 10))
DEFAULT_FROM_EMAIL = os.environ.get("DJANGO_DEFAULT_FROM_EMAIL", "Crowdtrain <noreply@localhost>")
SERVER_EMAIL = DEFAULT_FROM_EMAIL

# Limits on what users may send us.
DATA_UPLOAD_MAX_MEMORY_SIZE = int(os.environ.get("CROWDTRAIN_MAX_REQUEST_BYTES", 64 * 2**20))
FILE_UPLOAD_MAX_MEMORY_SIZE = 8 * 2**20
CROWDTRAIN = {
    "MAX_DATASET_BYTES": int(os.environ.get("CROWDTRAIN_MAX_DATASET_BYTES", 512 * 2**20)),
    # A dataset's arrays as stored (float32 samples, int32 labels); uint8 pixels grow fourfold.
    "MAX_DATASET_ARRAY_BYTES": int(os.environ.get("CROWDTRAIN_MAX_DATASET_ARRAY_BYTES", 2**30)),
    # Uncompressed over compressed size of an .npz beyond 32 MiB of arrays (zip bombs reach 1000).
    "MAX_DATASET_COMPRESSION_RATIO": int(os.environ.get("CROWDTRAIN_MAX_DATASET_COMPRESSION_RATIO", 100)),
    # Image-folder zips: images per dataset, pixels per image (from its header, before decoding: image
    # bombs) and bytes per image file.
    "MAX_DATASET_IMAGES": int(os.environ.get("CROWDTRAIN_MAX_DATASET_IMAGES", 100_000)),
    "MAX_IMAGE_PIXELS": int(os.environ.get("CROWDTRAIN_MAX_IMAGE_PIXELS", 4096 * 4096)),
    "MAX_IMAGE_BYTES": int(os.environ.get("CROWDTRAIN_MAX_IMAGE_BYTES", 32 * 2**20)),
    # JSON header of an uploaded weights.safetensors (real ones hold a few KB).
    "MAX_TENSOR_HEADER_BYTES": int(os.environ.get("CROWDTRAIN_MAX_TENSOR_HEADER_BYTES", 16 * 2**20)),
    "MAX_RESULT_BYTES": int(os.environ.get("CROWDTRAIN_MAX_RESULT_BYTES", 128 * 2**20)),
    # Result frames one daphne process handles at once, all connections together: over it, `busy`.
    "MAX_INFLIGHT_RESULT_BYTES": int(os.environ.get("CROWDTRAIN_MAX_INFLIGHT_RESULT_BYTES", 256 * 2**20)),
    "WS_CONNECTS_PER_MINUTE_USER": int(os.environ.get("CROWDTRAIN_WS_CONNECTS_PER_MINUTE_USER", 30)),
    "WS_CONNECTS_PER_MINUTE_IP": int(os.environ.get("CROWDTRAIN_WS_CONNECTS_PER_MINUTE_IP", 60)),
    "SHARD_SAMPLES": int(os.environ.get("CROWDTRAIN_SHARD_SAMPLES", 1000)),
    "WORK_UNIT_BUFFER": int(os.environ.get("CROWDTRAIN_WORK_UNIT_BUFFER", 8)),
    "WORK_UNIT_DEADLINE_SECONDS": int(os.environ.get("CROWDTRAIN_WU_DEADLINE", 120)),
    # A volunteer's second invalid result in a row pauses its new work this long, doubling with each further
    # one up to the cap (BOINC's daily quota plays this part); a valid result ends the streak.
    "INVALID_BACKOFF_SECONDS": int(os.environ.get("CROWDTRAIN_INVALID_BACKOFF_SECONDS", 60)),
    "INVALID_BACKOFF_MAX_SECONDS": int(os.environ.get("CROWDTRAIN_INVALID_BACKOFF_MAX_SECONDS", 24 * 3600)),
    "EVAL_EVERY_VERSIONS": int(os.environ.get("CROWDTRAIN_EVAL_EVERY", 5)),
    # Spot-checked work units at least this big (FLOPs) are recomputed by the server as soon as they are
    # sent; below it, recomputing at validation (milliseconds) costs less than a task to precompute it.
    "REFERENCE_MIN_FLOPS": int(os.environ.get("CROWDTRAIN_REFERENCE_MIN_FLOPS", 10**8)),
    # Time to accuracy against one machine (projects/baseline.py): every new project's graph is also trained
    # by one CPU process for at most these seconds and samples, unless a sample costs more FLOPs than the
    # bound (ResNet-18 and the GPT preset are over it; the MLP and CNN presets under). 0 seconds: never.
    "BASELINE_SECONDS": int(os.environ.get("CROWDTRAIN_BASELINE_SECONDS", 300)),
    "BASELINE_SAMPLES": int(os.environ.get("CROWDTRAIN_BASELINE_SAMPLES", 1_000_000)),
    "BASELINE_MAX_FLOPS_PER_SAMPLE": int(
        os.environ.get("CROWDTRAIN_BASELINE_MAX_FLOPS_PER_SAMPLE", 5 * 10**7)
    ),
    # API dataset uploads (PUT /api/uploads/<id>/): bytes per request, and how long an unfinished upload
    # is kept (its file lives in VAR_DIR/uploads until then).
    "MAX_UPLOAD_CHUNK_BYTES": int(os.environ.get("CROWDTRAIN_MAX_UPLOAD_CHUNK_BYTES", 8 * 2**20)),
    "UPLOAD_EXPIRY_HOURS": int(os.environ.get("CROWDTRAIN_UPLOAD_EXPIRY_HOURS", 24)),
    # Storage (projects/storage.py): old versions keep their weights only every Kth (plus the best and the
    # latest); a blob no row references is deleted once it was last stored this long ago.
    "KEEP_EVERY_K_VERSIONS": int(os.environ.get("CROWDTRAIN_KEEP_EVERY_K_VERSIONS", 10)),
    "BLOB_GC_GRACE_SECONDS": int(os.environ.get("CROWDTRAIN_BLOB_GC_GRACE_SECONDS", 3600)),
    # Fair share (projects/shares.py): the half-life of a project's recent compute, the window over which
    # running projects get volunteer FLOPs in proportion to their resource_share.
    "SHARE_HALF_LIFE_SECONDS": int(os.environ.get("CROWDTRAIN_SHARE_HALF_LIFE_SECONDS", 600)),
}
UPLOAD_ROOT = Path(os.environ.get("CROWDTRAIN_UPLOAD_ROOT", VAR_DIR / "uploads"))

# Throttles on logins (public and admin; failures per address and per account) and on sign-ups (per
# address), counted by django-ratelimit in the Redis cache. Rates are "<count>/<s|m|h|d>". Locally sign-ups
# are generous: the simulators and the end-to-end stacks sign many volunteers up from 127.0.0.1.
RATELIMIT_USE_CACHE = "default"
RATELIMIT_IP_META_KEY = "frontend.throttle.client_ip"
# django-ratelimit lists only django-redis and memcached as supported; Django's own RedisCache counts
# atomically too (INCRBY), which is all it needs.
SILENCED_SYSTEM_CHECKS = ["django_ratelimit.W001"]
CROWDTRAIN_LOGIN_RATE = os.environ.get("CROWDTRAIN_LOGIN_RATE", "10/m")
CROWDTRAIN_SIGNUP_RATE = os.environ.get("CROWDTRAIN_SIGNUP_RATE", "5/h" if PRODUCTION else "1000/h")
# Proxies in front of daphne that append the client's address to X-Forwarded-For and are trusted to: the
# client is the address that many entries from the right. 0: the connection's address (REMOTE_ADDR).
CROWDTRAIN_TRUSTED_PROXIES = int(os.environ.get("CROWDTRAIN_TRUSTED_PROXIES", 0))
# How long a dataset shard's signed URL (sent in an assign message) stays valid.
CROWDTRAIN_SHARD_URL_SECONDS = int(os.environ.get("CROWDTRAIN_SHARD_URL_SECONDS", 3600))

if PRODUCTION:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = env_bool("DJANGO_SECURE_SSL_REDIRECT", True)
    SECURE_HSTS_SECONDS = int(os.environ.get("DJANGO_HSTS_SECONDS", 31536000))
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    "loggers": {"django.channels.server": {"level": "WARNING"}},
}
