#!/bin/sh
# Container entry point. Roles:
#   web      wait for the database, migrate, collectstatic (unless CROWDTRAIN_RELEASE_ON_START=false:
#            several web replicas must not migrate at once; compose runs `release` once before them),
#            then serve HTTP + WebSockets with daphne
#   worker   a Celery worker (aggregation, evaluation, feeding work units; validations too)
#   validator a Celery worker for validations and spot-check recomputations only
#   baseline a Celery worker for the one-CPU time-to-accuracy baselines only, at the lowest CPU priority
#   beat     the Celery beat scheduler
#   migrate  apply database migrations and exit
#   release  migrate, create the blobs' bucket if one is named and missing, collectstatic, then exit: once
#            per deploy, before any web replica starts
# Anything else is run as a command, e.g. `docker compose run --rm web manage.py createsuperuser`.
set -eu
cd /app

wait_for_db() {
    python - <<'PY'
import os, sys, time
import django
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django.setup()
from django.db import connection
for attempt in range(60):
    try:
        connection.ensure_connection()
        sys.exit(0)
    except Exception as exc:  # noqa: BLE001 - any failure means "not yet"
        print(f"waiting for the database ({exc.__class__.__name__})...", flush=True)
        time.sleep(2)
sys.exit("the database did not become reachable in 2 minutes")
PY
}

role="${1:-web}"
case "$role" in
    web)
        wait_for_db
        if [ "${CROWDTRAIN_RELEASE_ON_START:-true}" = true ]; then
            python manage.py migrate --noinput
            python manage.py blob_bucket
            python manage.py collectstatic --noinput
        fi
        limit=$(( ${CROWDTRAIN_MAX_RESULT_BYTES:-134217728} + 1048576 ))  # results are single WebSocket frames
        # One file descriptor per volunteer's socket: the soft limit up to the hard one (config/asgi.py
        # does it too, for daphne started any other way). Raise the hard one with compose's `ulimits`.
        ulimit -n "$(ulimit -H -n)" 2>/dev/null || true
        # The listen backlog and handshake limit of runplatform's daphne_listen: a storm of reconnects
        # overflowed Twisted's default backlog (50) and daphne's 5 s handshake limit. config/web_server.py is
        # daphne with a connection check that does not walk every idle socket every second.
        exec python -m config.web_server --proxy-headers -e "tcp:port=${PORT:-8000}:interface=0.0.0.0:backlog=4096" \
            --websocket_connect_timeout 30 --websocket-max-message-size "$limit" \
            --websocket-max-frame-size "$limit" config.asgi:application
        ;;
    worker)
        wait_for_db
        # Both queues (validations have their own, see CELERY_TASK_ROUTES); solo: see runplatform's
        # worker_args. Scale with more worker containers (`--scale worker=N`); each names itself after
        # its container's host name, so replicas never share a Celery node name.
        exec celery -A config worker -Q celery,validation --pool solo -n "worker@%h" \
            -l "${CELERY_LOG_LEVEL:-info}"
        ;;
    validator)
        wait_for_db
        # Validations and the spot checks' recomputations only (runplatform's validator_args): a round's
        # results arrive together. Scale with `docker compose up --scale validator=N`.
        exec celery -A config worker -Q validation --pool solo -n "validator@%h" \
            -l "${CELERY_LOG_LEVEL:-info}"
        ;;
    baseline)
        wait_for_db
        # The `baseline` queue only (runplatform's baseline_args): minutes of single-threaded training per new
        # project, niced so that it never takes CPU from validation or a round. Keep it at one replica.
        exec nice -n 19 celery -A config worker -Q baseline --pool solo -l "${CELERY_LOG_LEVEL:-info}"
        ;;
    beat)
        exec celery -A config beat -l "${CELERY_LOG_LEVEL:-info}" -s /app/var/beat/celerybeat-schedule
        ;;
    migrate)
        wait_for_db
        exec python manage.py migrate --noinput
        ;;
    release)
        wait_for_db
        python manage.py migrate --noinput
        python manage.py blob_bucket  # creates CROWDTRAIN_BLOB_BUCKET if missing; nothing for local blobs
        exec python manage.py collectstatic --noinput
        ;;
    manage.py)
        shift
        exec python manage.py "$@"
        ;;
    *)
        exec "$@"
        ;;
esac
