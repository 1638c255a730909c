"""Tensors from a trainer process to the server on the same machine, without a disk round trip.

The trainer calls ``serialize_tensors(named_tensors)`` and posts the string to the server's
``POST /update_weights_from_tensor`` (field ``serialized_named_tensors``, SGLang's name). The
string holds no weights, only handles: a CUDA tensor travels as its CUDA IPC handle (the server
maps the trainer's GPU memory and copies from it straight into its own weights), a CPU tensor as
a named shared-memory file (torch's ``file_system`` sharing strategy: unrelated processes open it
by name). So the bytes sent are ~100 per tensor whatever its size, and the copy is one device
copy. The trainer keeps the tensors alive (and unchanged) until the server answered.

Why this and not a ``torch.distributed`` group (SGLang's ``init_weights_update_group``): a
group needs both sides to join a rendezvous and stay in step for every broadcast, and a GPU
NCCL group needs a second communicator beside the tensor-parallel one; IPC handles need
nothing but the two processes on one machine, which is the case this covers. A trainer on
another machine writes a checkpoint and calls ``/update_weights_from_disk``.

Only torch's tensor-rebuilding functions may be named by the payload (``receive_tensors``
refuses any other global): it is a pickle, and the endpoint sits behind the server's API key
all the same.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from collections.abc import Mapping
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing

_ALLOWED_TORCH = {"Tensor", "Size", "device", "UntypedStorage", "TypedStorage"}


class WeightTransferError(ValueError):
    """A payload ``receive_tensors`` cannot turn into named tensors; the message says why."""


def serialize_tensors(named_tensors: Mapping[str, torch.Tensor]) -> str:
    """The handles of ``named_tensors`` (checkpoint names -> tensors) as a base64 string."""
    if not isinstance(named_tensors, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in named_tensors.items()):
        raise TypeError("named_tensors: expected a mapping of names to tensors")
    torch.multiprocessing.set_sharing_strategy("file_system")
    payload = {name: tensor.detach() for name, tensor in named_tensors.items()}
    return base64.b64encode(bytes(ForkingPickler.dumps(payload))).decode()


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        allowed = (
            (module == "torch.multiprocessing.reductions" and name.startswith("rebuild_"))
            or (module == "torch._utils" and name.startswith("_rebuild_"))
            or (module == "torch.storage" and name in _ALLOWED_TORCH)
            or (module == "torch" and (name in _ALLOWED_TORCH
                                       or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module == "torch.nn.parameter" and name == "Parameter")
            or (module == "collections" and name == "OrderedDict"))
        if not allowed:
            raise WeightTransferError(f"the payload names {module}.{name}, which is not a "
                                      f"tensor-rebuilding function")
        return super().find_class(module, name)


def receive_tensors(serialized: str) -> dict[str, torch.Tensor]:
    """The named tensors a ``serialize_tensors`` string shares (mapped, not copied)."""
    try:
        data = base64.b64decode(serialized, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WeightTransferError(f"not base64: {exc}") from None
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        payload = _TensorUnpickler(io.BytesIO(data)).load()
    except WeightTransferError:
        raise
    except Exception as exc:  # noqa: BLE001 - a truncated or stale payload, a closed handle
        raise WeightTransferError(f"cannot rebuild the tensors: {exc!r}") from None
    if not isinstance(payload, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in payload.items()):
        raise WeightTransferError("expected a mapping of names to tensors")
    return payload
