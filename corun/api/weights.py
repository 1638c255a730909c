"""Weight updates over HTTP, for RL loops: ``POST /update_weights_from_disk`` (SGLang's name and
body) loads a checkpoint directory of the served model into the running engine, and
``POST /update_weights_from_tensor`` takes tensors a trainer process on the same machine shares
with the server (``corun.weight_transfer``: CUDA IPC handles on a GPU, shared memory on the
CPU), with no disk round trip.

Both wait for the requests in flight to finish, swap the weights between two steps and let the
queued requests start on the new ones (``EngineLoop.update_weights``); the answer carries the
new ``system_fingerprint``. A bad update (a missing tensor, a wrong shape or dtype, a path that
does not exist, another model's checkpoint) is a 400 naming the tensor or the path, and the
server keeps its old weights and keeps serving; an update that cannot run now (paused with
requests in flight, another update waiting) is a 409. Both routes sit behind the API key when
one is set. The answers have SGLang's ``success`` and ``message`` beside the server's usual
error object, so clients of either convention read them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from corun.api.engine_loop import EngineDeadError, WeightUpdateConflict
from corun.api.errors import APIError

if TYPE_CHECKING:
    from corun.api.server import ServerState

# SGLang's options of these endpoints that change what an update does: refused, not ignored.
_UNSUPPORTED = {
    "abort_all_requests": "in-flight requests always finish on the old weights",
    "flush_cache": "the prefix cache is always emptied",
    "weight_version": "the system_fingerprint identifies the weights",
    "is_async": "the answer comes once the weights are in place",
    "keep_pause": "/pause and /resume are separate calls",
    "recapture_cuda_graph": "weights are copied in place; the graphs stay valid",
    "torch_empty_cache": "not needed: no memory is reallocated",
    "token_step": "not supported",
}


class _UpdateBody(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class UpdateFromDiskRequest(_UpdateBody):
    model_path: str
    load_format: str | None = None


class UpdateFromTensorRequest(_UpdateBody):
    serialized_named_tensors: str


def _parse(model: type[_UpdateBody], raw: bytes) -> _UpdateBody:
    try:
        body = model.model_validate_json(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(p) for p in error["loc"]) or None
        raise APIError(400, f"{field}: {error['msg']}", field) from None
    for name in body.model_extra or {}:
        reason = _UNSUPPORTED.get(name, "not a field of this endpoint")
        raise APIError(400, f"{name}: not supported ({reason})", name)
    return body


def _failure(status: int, message: str, code: str) -> JSONResponse:
    error = {"message": message, "type": "invalid_request_error" if status < 500
             else "server_error", "param": None, "code": code}
    return JSONResponse({"success": False, "message": message, "error": error},
                        status_code=status)


async def _update(state: ServerState, weights: Any) -> JSONResponse:
    from models.loader import CheckpointError

    try:
        fingerprint = await state.run_blocking(state.engine_loop.update_weights, weights)
    except CheckpointError as exc:
        return _failure(400, str(exc), "bad_weights")
    except WeightUpdateConflict as exc:
        return _failure(409, str(exc), "update_conflict")
    except EngineDeadError as exc:
        return _failure(503, str(exc), "engine_dead")
    return JSONResponse({"success": True, "message": "weights updated",
                         "system_fingerprint": fingerprint})


def add_weight_routes(app: FastAPI, state: ServerState) -> None:
    """The two update routes on ``app`` (the server's API-key middleware covers them)."""

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(raw: Request) -> JSONResponse:
        body = _parse(UpdateFromDiskRequest, await raw.body())
        if body.load_format not in (None, "auto", "safetensors"):
            raise APIError(400, f"load_format: {body.load_format!r} not supported (auto, "
                           f"safetensors)", "load_format")
        return await _update(state, body.model_path)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(raw: Request) -> JSONResponse:
        from corun.weight_transfer import WeightTransferError, receive_tensors

        body = _parse(UpdateFromTensorRequest, await raw.body())
        try:
            tensors = await state.run_blocking(receive_tensors, body.serialized_named_tensors)
        except WeightTransferError as exc:
            return _failure(400, f"serialized_named_tensors: {exc}", "bad_weights")
        return await _update(state, tensors)

