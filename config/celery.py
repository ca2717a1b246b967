import os
from typing import Any

from celery import Celery
from celery.signals import worker_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("crowdtrain")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_init.connect
def _prepare_torch(**_: Any) -> None:
    """Spot checks recompute small models, where per-operation threads only add synchronisation: a
    3,000-sample MLP recompute took 83 ms with 2 threads and 42 ms with 1 here (raise it for big models).
    Shape inference imports torch._dynamo on first use (2 s): pay that now, not in the first spot check."""
    import torch
    import torch._dynamo  # noqa: F401

    torch.set_num_threads(int(os.environ.get("CROWDTRAIN_TORCH_THREADS", "1")))
