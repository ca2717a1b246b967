"""The platform as separate local processes (daphne, Celery workers and beat on PostgreSQL and Redis), for
the tests that need real processes and for the benchmarks. Neither part of the platform nor of the tests."""
