"""Crowdtrain's researcher client: push a PyTorch model, follow its training on volunteers' browsers,
pull the trained weights back into the original module.

    import crowdtrain
    client = crowdtrain.Client("https://crowdtrain.example.org", token)   # or Client.from_config()
    crowdtrain.load_into(model, project=12, version="best", client=client)
"""

from ._version import __version__
from .checkpoint import Loaded, load_into, load_tensors
from .client import Checkpoint, Client, login
from .errors import ApiError, CheckpointMismatch, CrowdtrainError, NotLoggedIn, ServerUnreachable
from .exporting import Exported, export

__all__ = [
    "ApiError",
    "Checkpoint",
    "CheckpointMismatch",
    "Client",
    "CrowdtrainError",
    "Exported",
    "Loaded",
    "NotLoggedIn",
    "ServerUnreachable",
    "__version__",
    "export",
    "load_into",
    "load_tensors",
    "login",
]
