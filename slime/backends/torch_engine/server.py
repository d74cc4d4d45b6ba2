"""HTTP layer (aiohttp): SGLang's native endpoints, translated into engine and scheduler calls.

Only this module knows about HTTP. Handlers run on the asyncio loop; anything that touches the model
is sent to the scheduler thread (`Scheduler.call`) and blocking collectives to the engine's
weight-update executor, so the loop stays free to accept requests and aborts at all times.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import logging
import os
import pickle
import secrets
import threading
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from slime.backends.torch_engine import faults, lora, protocol, weights
from slime.backends.torch_engine.engine import TorchEngine
from slime.backends.torch_engine.protocol import ProtocolError, SamplingParams, UnhandledError
from slime.backends.torch_engine.request import Request
from slime.backends.torch_engine.sampling import RowSampling
from slime.weight_sync import ipc

logger = logging.getLogger(__name__)

ENGINE = web.AppKey("engine", TorchEngine)


class Admission:
    """What SGLang's tokenizer manager does before the scheduler sees a request (0.5.19-0.5.23,
    ``srt/managers/tokenizer_manager.py``): every request is known by its rid from arrival
    (``rid_to_state``), and while generation is paused new requests wait *here*, so the scheduler's
    ``abort_all`` does not reach them: they run after ``/continue_generation``.

    ``abort_request {"rid"}`` only acts on a rid known here, exactly (with one tokenizer worker
    SGLang drops other rids, prefixes included); from 0.5.20 on only the first abort of a rid is
    sent on (``abort_sent``), so the abort of a request held by a pause is lost for good.
    """

    def __init__(self, abort_once: bool) -> None:
        self.abort_once = abort_once
        self.open = asyncio.Event()
        self.open.set()
        self.abort_sent: dict[str, bool] = {}

    def admit(self, rids: list[str]) -> None:
        self.abort_sent.update(dict.fromkeys(rids, False))

    def leave(self, rids: list[str]) -> None:
        for rid in rids:
            self.abort_sent.pop(rid, None)

    def should_forward_abort(self, rid: str) -> bool:
        if rid not in self.abort_sent:
            return False
        if self.abort_once:
            if self.abort_sent[rid]:
                return False
            self.abort_sent[rid] = True
        return True


ADMISSION = web.AppKey("admission", Admission)
MAX_BODY_BYTES = 4 << 30  # update_weights_from_tensor carries whole tensors as base64

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str) -> web.Response:
    return web.json_response(protocol.error_body(message), status=status)


def _result(success: bool, message: str, **extra: Any) -> web.Response:
    return web.json_response(
        {"success": success, "message": message, **extra}, status=200 if success else 400
    )


async def _body(request: web.Request) -> dict[str, Any]:
    """The JSON body (GET endpoints may carry one, as with FastAPI) merged over the query parameters."""
    data: dict[str, Any] = dict(request.query)
    if request.can_read_body:
        try:
            parsed = await request.json()
        except ValueError as exc:
            raise ProtocolError(f"the request body is not valid JSON: {exc}") from exc
        if parsed is not None:
            if not isinstance(parsed, dict):
                raise ProtocolError("the request body must be a JSON object")
            data.update(parsed)
    return data


async def _on_scheduler(engine: TorchEngine, fn: Callable[[], Any]) -> Any:
    return await asyncio.wrap_future(engine.scheduler.call(fn))


class Replies:
    """Replies the scheduler thread finished, handed to the event loop with one wake-up per batch.

    A decode step often finishes a whole wave at once (the quickstart's 128 samples end on the same
    step); waking the loop once per reply was a self-pipe write and a GIL hand-over each, about 3 ms
    a step on 2 cores with the trainer beside it (py-spy, 2026-12-05)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: list[tuple[asyncio.Future, dict[str, Any]]] = []
        self._loop: asyncio.AbstractEventLoop | None = None  # set while a drain is scheduled on it

    def callback(
        self, loop: asyncio.AbstractEventLoop, future: asyncio.Future
    ) -> Callable[[dict[str, Any]], None]:
        """A scheduler-thread callback that resolves ``future`` on ``loop``."""

        def deliver(reply: dict[str, Any]) -> None:
            with self._lock:
                self._ready.append((future, reply))
                if self._loop is not None:
                    return
                self._loop = loop
            loop.call_soon_threadsafe(self._resolve)

        return deliver

    def _resolve(self) -> None:
        with self._lock:
            ready, self._ready, self._loop = self._ready, [], None
        for future, reply in ready:
            if not future.done():
                future.set_result(reply)


REPLIES = web.AppKey("replies", Replies)


def _protocol_errors(handler: Handler) -> Handler:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except UnhandledError as exc:
            logger.error("%s: %s", request.path, exc)
            return web.Response(status=500, text="Internal Server Error")
        except ProtocolError as exc:
            return _error(exc.status, str(exc))

    return wrapped


# ---- generation ---------------------------------------------------------------------------------


async def generate(request: web.Request) -> web.StreamResponse:
    engine, admission = request.app[ENGINE], request.app[ADMISSION]
    body = await _body(request)
    inputs, batched = protocol.parse_generate(body)
    reason = engine.refuse_generation("/generate")
    if reason is not None:
        return _error(503, reason)
    rids = [gen.rid for gen in inputs]
    admission.admit(rids)
    try:
        await admission.open.wait()  # held while paused, before the scheduler (see Admission)
        reason = engine.refuse_generation("/generate")  # memory may have been released meanwhile
        if reason is not None:
            return _error(503, reason)
        names = [gen.lora_path for gen in inputs]
        adapters = [None] * len(inputs)
        if any(names):  # resolved before tokenizing, as SGLang's tokenizer manager does
            as_list = isinstance(body.get("lora_path"), list)
            adapters = await _on_scheduler(engine, lambda: engine.acquire_adapters(names, as_list))
        built = [engine.build_request(gen) for gen in inputs]
        for req, adapter in zip(built, adapters, strict=True):
            req.lora = adapter
        replies = await _run_requests(engine, request.app[REPLIES], built)
    finally:
        admission.leave(rids)
    return web.json_response(replies if batched else replies[0])


async def _run_requests(
    engine: TorchEngine, replies: Replies, requests: list[Request]
) -> list[dict[str, Any]]:
    loop = asyncio.get_running_loop()
    futures = []
    for req in requests:
        future = loop.create_future()
        req.on_finish = replies.callback(loop, future)
        futures.append(future)
        engine.scheduler.submit(req)
    try:
        return list(await asyncio.gather(*futures))
    except asyncio.CancelledError:  # the client went away: stop generating for it, as SGLang does
        for req in requests:
            engine.scheduler.abort(req.rid)
        raise


def health_check_timeout_s() -> float:
    """SGLang's ``SGLANG_HEALTH_CHECK_TIMEOUT`` (``entrypoints/http_server.py``, 0.5.19-0.5.23; 20 s)."""
    return float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))


def health_generates() -> bool:
    """SGLang's ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` (``srt/environ.py``, default true): when
    false, ``GET /health`` answers 200 at once and only ``/health_generate`` generates."""
    return os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower() not in ("0", "false")


async def health_generate(request: web.Request) -> web.Response:
    """``GET /health`` and ``GET /health_generate``: one handler, as in SGLang 0.5.19-0.5.23
    (``http_server.health_generate``): 200 once a one-token greedy generation came back, 503 when none
    did within ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds.

    The probe goes where a request goes, so it behaves as SGLang's does where that matters to slime:
    while generation is paused it waits at admission (SGLang's tokenizer manager holds it on
    ``is_pause_cond``) and the answer is 503 after the timeout, so a router health check drops a paused
    engine; sent to an engine whose memory is released it is a generation that must never happen
    (SGLang would run it on freed memory), so it is refused with 503, logged and counted
    (``generations_while_released`` in ``/get_server_info``).
    """
    engine, admission = request.app[ENGINE], request.app[ADMISSION]
    if engine.shutting_down or not engine.scheduler.is_alive():
        return web.Response(status=503)
    if request.path == "/health" and not health_generates():
        return web.Response(status=200)
    if engine.refuse_generation("a health check") is not None:
        return web.Response(status=503)
    probe = Request(
        rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
        input_ids=[0],
        params=SamplingParams(max_new_tokens=1, temperature=0.0),
        max_new_tokens=1,
        sampling=RowSampling(temperature=0.0),
    )

    async def admitted_probe() -> bool:
        await admission.open.wait()
        if engine.refuse_generation("a health check") is not None:
            return False
        await _run_requests(engine, request.app[REPLIES], [probe])
        return True

    timeout_s = health_check_timeout_s()
    admission.admit([probe.rid])
    try:
        ok = await asyncio.wait_for(admitted_probe(), timeout_s)
    except asyncio.TimeoutError:
        logger.error(
            "health check: no generation within %.0f s (paused: %s)", timeout_s, engine.scheduler.paused
        )
        return web.Response(status=503)
    finally:
        admission.leave([probe.rid])
    return web.Response(status=200 if ok else 503)


async def abort_request(request: web.Request) -> web.Response:
    engine, admission = request.app[ENGINE], request.app[ADMISSION]
    body = await _body(request)
    rid = str(body.get("rid") or "")
    if body.get("abort_all"):
        engine.scheduler.abort(abort_all=True)
    elif rid and admission.should_forward_abort(rid):
        engine.scheduler.abort(rid)  # the scheduler matches by prefix, as SGLang's does
    return web.Response(status=200)


async def pause_generation(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    mode = (await _body(request)).get("mode") or "abort"
    if mode not in ("abort", "retract", "in_place"):
        raise ProtocolError(f"mode must be one of abort, retract, in_place; got {mode!r}")
    request.app[ADMISSION].open.clear()
    await _on_scheduler(engine, lambda: engine.scheduler.pause(mode))
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    await _on_scheduler(engine, engine.scheduler.resume)
    request.app[ADMISSION].open.set()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def flush_cache(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    ok, message = await _on_scheduler(engine, engine.flush_cache)
    return web.Response(text=message, status=200 if ok else 400)


# ---- information --------------------------------------------------------------------------------


async def get_model_info(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE].model_info())


async def v1_models(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE].models())


async def get_server_info(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE].server_info())


async def get_load(request: web.Request) -> web.Response:
    """The deprecated shim over /v1/loads (SGLang <= 0.5.20)."""
    load = request.app[ENGINE].scheduler.load()
    return web.json_response(
        [
            {
                "dp_rank": 0,
                "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                "num_waiting_reqs": load["num_waiting_reqs"],
                "num_tokens": load["num_tokens"],
            }
        ]
    )


async def v1_loads(request: web.Request) -> web.Response:
    """``GET /v1/loads`` (SGLang's ``entrypoints/v1_loads.py``): one load entry per DP rank."""
    engine = request.app[ENGINE]
    load = engine.scheduler.load()
    return web.json_response(
        {
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "version": engine.release.version,
            "accelerator": None,
            "num_accelerators": 1,
            "loads": [
                {
                    "dp_rank": 0,
                    "num_running_reqs": load["num_running_reqs"],
                    "num_waiting_reqs": load["num_waiting_reqs"],
                    "num_used_tokens": load["num_tokens"],
                    "max_running_requests": engine.max_running_requests,
                }
            ],
        }
    )


def _openai_error(status: int, message: str, kind: str) -> web.Response:
    """SGLang's ``ErrorResponse`` body, which its HTTPException and validation handlers answer with."""
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.json_response(body, status=status)


async def weight_version_moved(request: web.Request) -> web.Response:
    """SGLang 0.5.19-0.5.20 answer 404 here (the routes are gone from 0.5.21): /model_info has it."""
    message = (
        "Endpoint '/get_weight_version' or '/weight_version' is deprecated. Please use '/model_info' instead."
    )
    return _openai_error(404, message, "404")


async def update_weight_version(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await _body(request)
    version = body.get("new_version")
    if not isinstance(version, str):
        return _result(False, "Failed to update weight version: new_version (a string) is required")
    if body.get("abort_all_requests", True):
        await _on_scheduler(engine, engine.scheduler.abort_all)
    engine.scheduler.weight_version = version
    return _result(True, f"Weight version updated to {version}", new_version=version)


async def get_weights_by_name(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await _body(request)
    name, size = body.get("name"), int(body.get("truncate_size", 100))
    try:
        values = await _on_scheduler(engine, lambda: engine.weights.get(str(name), size))
    except (KeyError, RuntimeError) as exc:
        return _error(400, f"Get parameter by name failed: {exc}")
    return web.json_response(values)


async def check_weights(request: web.Request) -> web.Response:
    """SGLang's ``/weights_checker`` (``weight_checker.py``): snapshot, reset_tensors, compare."""
    engine = request.app[ENGINE]
    body = await _body(request)
    action, skip = str(body.get("action", "checksum")), body.get("skip_tensor_list")
    try:
        await _on_scheduler(engine, lambda: engine.weight_checker.handle(action, skip))
    except ValueError as exc:
        return _result(False, str(exc))
    return _result(True, "Success.")


# ---- weight updates -----------------------------------------------------------------------------


async def begin_weight_update(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    selector = (await _body(request)).get("selector", "all")
    if selector not in ("target", "draft", "all"):  # SGLang's Literal check: a validation error
        return _openai_error(
            400, f"selector: Input should be 'target', 'draft' or 'all', got {selector!r}", "Bad Request"
        )
    ok, message = await _on_scheduler(engine, lambda: engine.begin_weight_update(selector))
    return _result(ok, message)


async def end_weight_update(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    ok, message = await _on_scheduler(engine, engine.end_weight_update)
    return _result(ok, message)


async def init_weights_update_group(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await _body(request)
    missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body]
    if missing:
        return _result(False, f"Failed to initialize custom process group: missing {missing}")
    ok, message = await asyncio.get_running_loop().run_in_executor(
        engine.update_groups.executor, engine.update_groups.init, body
    )
    return _result(ok, message)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    name = (await _body(request)).get("group_name") or "weight_update_group"
    engine.update_groups.cancel(name)  # a receive stuck on it (its sender gave up) must not hold the executor
    ok, message = await asyncio.get_running_loop().run_in_executor(
        engine.update_groups.executor, engine.update_groups.destroy, name
    )
    return _result(ok, message)


async def _apply(engine: TorchEngine, body: dict[str, Any], tensors: list) -> tuple[bool, str]:
    # The body's flush_cache has nothing to free on this engine (TorchEngine.flush_cache).
    version = body.get("weight_version")
    return await _on_scheduler(engine, lambda: engine.load_weights(tensors, version))


async def _update_weights(
    engine: TorchEngine,
    body: dict[str, Any],
    endpoint: str,
    read: Callable[[], list],
    executor: concurrent.futures.Executor | None = None,
) -> tuple[bool, str]:
    """What every weight update does around its own ``read`` of the tensors: abort in-flight requests
    if asked, ``read`` on ``executor`` (off the loop), load them between two forwards, record the new
    weight version. A failure is logged here and answered in SGLang's words by the handler."""
    try:
        if body.get("abort_all_requests"):
            await _on_scheduler(engine, engine.scheduler.abort_all)
        tensors = await asyncio.get_running_loop().run_in_executor(executor, read)
        ok, message = await _apply(engine, body, tensors)
        del tensors  # they may map the sender's memory: release it as soon as the copy is done
    except Exception as exc:
        ok, message = False, f"Failed to update weights: {exc}"
    if not ok:
        logger.error("%s: %s", endpoint, message)
        return ok, message
    engine.record(endpoint, version=body.get("weight_version"))
    return ok, message


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await _body(request)
    refusal = engine.outside_session("update_weights_from_distributed")
    if refusal is not None:  # answered before any receive: the sender's broadcast finds no peer
        return _result(False, refusal)
    ok, message = await _update_weights(
        engine,
        body,
        "update_weights_from_distributed",
        lambda: engine.update_groups.receive(body),
        engine.update_groups.executor,
    )
    return _result(ok, message)


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await _body(request)
    refusal = engine.outside_session("update_weights_from_tensor")
    if refusal is not None:
        return _result(False, refusal)
    entries = body.get("serialized_named_tensors")
    if not isinstance(entries, list) or not entries:
        return _result(False, "serialized_named_tensors must be a non-empty list (one entry per TP rank)")
    # One entry per TP rank; this engine is TP rank 0 of a TP-1 engine.
    ok, message = await _update_weights(
        engine,
        body,
        "update_weights_from_tensor",
        lambda: weights.deserialize_named_tensors(entries[0], body.get("load_format")),
    )
    return _result(ok, message)


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await _body(request)
    path = body.get("model_path")
    if not isinstance(path, str):
        return _result(False, "model_path is required", num_paused_requests=0)
    ok, message = await _update_weights(
        engine, body, "update_weights_from_disk", lambda: list(weights.iter_safetensors(path))
    )
    if ok:
        engine.model_path = str(Path(path).resolve())
    return _result(ok, message, num_paused_requests=0)


async def release_memory_occupation(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    tags = (await _body(request)).get("tags")
    await _on_scheduler(engine, lambda: engine.release_memory(tags))
    return web.json_response(None)


async def resume_memory_occupation(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    tags = (await _body(request)).get("tags")
    await _on_scheduler(engine, lambda: engine.resume_memory(tags))
    return web.json_response(None)


# ---- LoRA adapters ------------------------------------------------------------------------------
# SGLang 0.5.19-0.5.23 (``entrypoints/http_server.py``): each answers ``LoRAUpdateOutput`` (see
# ``lora.update_output``), HTTP 200 on success and 400 on failure.


def _lora_reply(result: dict[str, Any]) -> web.Response:
    return web.json_response(result, status=200 if result["success"] else 400)


def _missing(body: dict[str, Any], *fields: str) -> web.Response | None:
    """SGLang's request validation of a required field (the engine answers it as other validation errors)."""
    for name in fields:
        if name not in body:
            return _openai_error(400, f"{name}: Field required", "Bad Request")
    return None


async def load_lora_adapter(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await _body(request)
    refusal = _missing(body, "lora_name", "lora_path")
    if refusal is not None:
        return refusal
    name, path, pinned = str(body["lora_name"]), str(body["lora_path"]), bool(body.get("pinned", False))
    return _lora_reply(await _on_scheduler(engine, lambda: engine.load_lora_adapter(name, path, pinned)))


def _adapter_tensors(body: dict[str, Any]) -> dict[str, Any]:
    """The adapter's ``{name: tensor}`` from TP rank 0's entry: SGLang's MultiprocessingSerializer of a
    dict (or of a flattened bucket with ``load_format="flattened_bucket"``), base64 on HTTP."""
    entries = body["serialized_named_tensors"]
    if not isinstance(entries, list) or not entries:
        raise ValueError("serialized_named_tensors must be a non-empty list (one entry per TP rank)")
    payload = ipc.deserialize(entries[0])
    if body.get("load_format") == "flattened_bucket":
        return dict(ipc.named_tensors_from_payload(payload, "flattened_bucket"))
    if not isinstance(payload, dict):
        raise ValueError("an adapter entry must be a dict of tensors by name")
    return payload


def _checksum_mismatch(tensors: dict[str, Any], expected: dict[str, str]) -> str | None:
    """SGLang's ``expected_checksums`` check (``tp_worker.load_lora_adapter_from_tensors``), its words."""
    mismatch = [
        n for n, want in expected.items() if n in tensors and lora.tensor_checksum(tensors[n]) != want
    ]
    missing = [n for n in expected if n not in tensors]
    extra = [n for n in tensors if n not in expected]
    if not (mismatch or missing or extra):
        return None
    return (
        f"[LORA-CHECK] rank0 adapter sync MISMATCH of {len(expected)} expected: "
        f"{len(mismatch)} value-diff {mismatch[:5]}, {len(missing)} missing {missing[:5]}, "
        f"{len(extra)} extra {extra[:5]}"
    )


async def load_lora_adapter_from_tensors(request: web.Request) -> web.Response:
    """The whole adapter in one call: its PEFT ``config_dict`` and every tensor."""
    engine = request.app[ENGINE]
    body = await _body(request)
    refusal = _missing(body, "lora_name", "config_dict", "serialized_named_tensors")
    if refusal is not None:
        return refusal
    if engine.lora is None:
        return _lora_reply(lora.update_output(False, lora.NOT_ENABLED, None))
    name, config = str(body["lora_name"]), body["config_dict"]
    try:
        tensors = await asyncio.get_running_loop().run_in_executor(None, _adapter_tensors, body)
    except (ValueError, pickle.UnpicklingError, EOFError) as exc:
        return _lora_reply(lora.update_output(False, f"serialized_named_tensors: {exc}", None))
    if body.get("expected_checksums") is not None:
        mismatch = _checksum_mismatch(tensors, body["expected_checksums"])
        if mismatch is not None:
            return _lora_reply(lora.update_output(False, mismatch, None))
    result = await _on_scheduler(
        engine,
        lambda: engine.load_lora_adapter_from_tensors(
            name, config, tensors, bool(body.get("pinned", False)), body.get("added_tokens_config")
        ),
    )
    return _lora_reply(result)  # the adapter holds copies: the sender's memory is no longer mapped


async def unload_lora_adapter(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await _body(request)
    refusal = _missing(body, "lora_name")
    if refusal is not None:
        return refusal
    name = str(body["lora_name"])
    return _lora_reply(await _on_scheduler(engine, lambda: engine.unload_lora_adapter(name)))


async def get_lora_weights_by_name(request: web.Request) -> web.Response:
    """Torch-engine only (SGLang has no read-back of adapter weights): ``{"lora_name", "name",
    "truncate_size": 100}`` -> the adapter tensor of that PEFT name as get_weights_by_name answers a
    parameter, so a test can compare the served adapter with the trainer's."""
    engine = request.app[ENGINE]
    body = await _body(request)
    if engine.lora is None:
        return _error(400, lora.NOT_ENABLED)
    lora_name, name, size = (
        str(body.get("lora_name")),
        str(body.get("name")),
        int(body.get("truncate_size", 100)),
    )
    try:
        values = await _on_scheduler(engine, lambda: engine.lora.read(lora_name, name, size))  # type: ignore[union-attr]
    except lora.LoraError as exc:
        return _error(400, f"Get LoRA tensor by name failed: {exc}")
    return web.json_response(values)


# ---- app ----------------------------------------------------------------------------------------

ROUTES: list[tuple[tuple[str, ...], str, Handler]] = [
    (("GET",), "/health", health_generate),
    (("GET",), "/health_generate", health_generate),
    (("GET",), "/get_model_info", get_model_info),
    (("GET",), "/model_info", get_model_info),
    (("GET",), "/get_server_info", get_server_info),
    (("GET",), "/server_info", get_server_info),
    (("GET",), "/v1/loads", v1_loads),
    (("GET",), "/v1/models", v1_models),
    (("POST", "PUT"), "/generate", generate),
    (("POST",), "/abort_request", abort_request),
    (("POST",), "/pause_generation", pause_generation),
    (("POST",), "/continue_generation", continue_generation),
    (("GET", "POST"), "/flush_cache", flush_cache),
    (("POST",), "/update_weight_version", update_weight_version),
    (("GET", "POST"), "/get_weights_by_name", get_weights_by_name),
    (("POST",), "/init_weights_update_group", init_weights_update_group),
    (("POST",), "/destroy_weights_update_group", destroy_weights_update_group),
    (("POST",), "/update_weights_from_distributed", update_weights_from_distributed),
    (("POST",), "/update_weights_from_tensor", update_weights_from_tensor),
    (("POST",), "/update_weights_from_disk", update_weights_from_disk),
    (("GET", "POST"), "/release_memory_occupation", release_memory_occupation),
    (("GET", "POST"), "/resume_memory_occupation", resume_memory_occupation),
    (("POST",), "/load_lora_adapter", load_lora_adapter),
    (("POST",), "/load_lora_adapter_from_tensors", load_lora_adapter_from_tensors),
    (("POST",), "/unload_lora_adapter", unload_lora_adapter),
    (("GET", "POST"), "/get_lora_weights_by_name", get_lora_weights_by_name),
    (("GET", "POST"), "/weights_checker", check_weights),
]


# Routes only some releases serve (SGLang's http_server.py of each): predicate on the release.
RELEASE_ROUTES: list[tuple[tuple[str, ...], str, Handler, Callable[[protocol.SglangRelease], bool]]] = [
    (("GET",), "/get_load", get_load, lambda r: r.get_load),
    (("GET",), "/get_weight_version", weight_version_moved, lambda r: not r.weight_update_sessions),
    (("GET",), "/weight_version", weight_version_moved, lambda r: not r.weight_update_sessions),
    (("POST",), "/begin_weight_update", begin_weight_update, lambda r: r.weight_update_sessions),
    (("POST",), "/end_weight_update", end_weight_update, lambda r: r.weight_update_sessions),
]


# Paths SGLang serves without a key even when it has one (``decide_request_auth`` in
# ``srt/utils/auth.py``: ``/health*`` and ``/metrics`` in 0.5.19, ``/ready`` too in 0.5.23), so probes
# need no secret.
OPEN_PATH_PREFIXES = ("/health", "/ready", "/metrics")


def api_key_middleware(api_key: str) -> Middleware:
    """SGLang's ``--api-key`` check (``add_api_key_middleware``, 0.5.19-0.5.23): every request but
    OPTIONS and the open paths needs ``Authorization: Bearer <api_key>``, else 401
    ``{"error": "Unauthorized"}``. The comparison takes constant time, as SGLang's does."""
    expected = api_key.encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "OPTIONS" and not request.path.startswith(OPEN_PATH_PREFIXES):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            given = token.encode(errors="surrogateescape")  # aiohttp decodes odd bytes as surrogates
            if scheme.lower() != "bearer" or not secrets.compare_digest(given, expected):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check


def create_app(engine: TorchEngine) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    if engine.args.api_key:  # first, so that no other middleware or handler sees an unauthorized request
        app.middlewares.append(api_key_middleware(engine.args.api_key))
    app[ENGINE] = engine
    faults.install(app)  # the fault-tolerance tests' hook; inactive unless armed
    app[ADMISSION] = Admission(abort_once=engine.release.abort_once)
    app[REPLIES] = Replies()
    routes = ROUTES + [route[:3] for route in RELEASE_ROUTES if route[3](engine.release)]
    for methods, path, handler in routes:
        for method in methods:
            app.router.add_route(method, path, _protocol_errors(handler))

    async def on_shutdown(app: web.Application) -> None:
        # Abort running requests (their handlers answer with what was produced) and close the groups.
        await asyncio.get_running_loop().run_in_executor(None, app[ENGINE].shutdown)

    app.on_shutdown.append(on_shutdown)
    return app
