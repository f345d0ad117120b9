"""Model repository (DStore): models stored as tensors plus a compact architecture graph
with stable IDs.

    repo = forebay.models.open_repository("file:///scratch/models")
    v = repo.save("resnet", model, metadata={"epoch": 3})     # next version
    repo.load("resnet", into=model)                           # in place, verified
    repo.load("resnet", include="layer4.*")                   # only those tensors read
    repo.load_matching("resnet", new_model)                   # transfer: by structure
    forebay.models.import_safetensors(repo, "model.safetensors", "llm")   # and export_...

Each tensor is stored once by content, so a version that changes k layers adds only
those bytes; a version is visible only after all its tensors are durable.
"""

from ._arch import Architecture, IdCache, Leaf, capture, stable_ids
from ._provider import serve
from ._remote import RemoteRepository
from ._wire import token_from_file
from ._open import open_repository
from ._repo import Repository
from ._store import ModelStore
from ._tensors import tensor_hash
from ._safetensors import export_safetensors, import_safetensors

__all__ = ["open_repository", "ModelStore", "Repository", "capture", "Architecture", "Leaf",
           "IdCache", "RemoteRepository", "serve", "stable_ids", "tensor_hash", "token_from_file",
           "import_safetensors", "export_safetensors"]
