"""SGLang's native HTTP protocol as the torch engine speaks it: request parsing, reply shapes, releases.

The engine mirrors one SGLang release at a time (``--sglang-release``, default the newest supported,
``SglangRelease`` below lists what differs); slime's client is tested against the oldest and the newest.
Known differences from the real server: a receive stuck in a weight-update broadcast whose sender gave
up ends when its group is destroyed (SGLang's scheduler stays in it until the group's timeout, and
its session and pause calls wait too); a running request aborted keeps the tokens it had (SGLang
decodes one more token first); an idle scheduler gathers requests arriving together for up to 5 ms
before its first prefill (``scheduler.GATHER_MAX_S``; SGLang prefills at once unless its prefill
delayer is on).

Facts taken from SGLang 0.5.23 (`sglang/srt/entrypoints/http_server.py`, `managers/io_struct.py`,
`managers/tokenizer_manager.py`, `managers/detokenizer_manager.py`, `managers/schedule_batch.py`,
`sampling/sampling_params.py`; `/get_load` and `/get_weight_version` from 0.5.3, removed later):

- POST /generate: `text` | `input_ids` (a list makes a batch), `sampling_params`, `rid`,
  `return_logprob`, `logprob_start_len` (-1: output logprobs only), `return_text_in_logprobs`, `stream`,
  and for a vision-language model `image_data` (``vision.py``: forms, prompt expansion, errors,
  meta_info["image_tokens"]; a text model refuses it), and `lora_path`: the name of a loaded LoRA adapter,
  one string for every request of a batch or a list with one name (or None: the base) per request
  (``lora.py``: resolution, implicit reloads, errors); `return_routed_experts` and
  `routed_experts_start_len` (one value for every request of a batch, as
  ``GenerateReqInput.__getitem__`` hands them on): ``meta_info["routed_experts"]`` with the engine's
  ``--enable-return-routed-experts`` (``routed_experts.py``), absent without it.
  Reply `{"text", "output_ids", "meta_info"}`; meta_info = {"id", "finish_reason", "prompt_tokens",
  "weight_version", "num_retractions", "completion_tokens", "cached_tokens", "e2e_latency"} plus, with
  return_logprob, "input_token_logprobs", "output_token_logprobs" (lists of `[logprob, token_id, text]`,
  text None unless return_text_in_logprobs; the first input entry's logprob is None) and
  "output_token_logprobs_length". A bad request is HTTP 400 `{"error": {"message": ...}}`.
- finish_reason: `{"type": "stop", "matched": <token id int | stop string>}`,
  `{"type": "length", "length": max_new_tokens}`,
  `{"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}` (a running request),
  `{"type": "abort", "message": "Abort in waiting queue"}` (one taken from the waiting queue, whose
  meta_info is shorter: see `replies.generate_reply`); None while running.
  Precedence per token: stop string, then stop token / EOS, then length. `ignore_eos` disables stop
  tokens as well as EOS. `output_ids` keep the matched stop token; `text` drops it (a matched string is
  cut at its first occurrence) unless `no_stop_trim`.
- sampling_params defaults: max_new_tokens 128, temperature 1, top_p 1, top_k -1 (= whole vocab; 0 is
  rejected), min_p 0, min_new_tokens 0, skip_special_tokens True, no_stop_trim False. Temperature 0
  means greedy. A prompt of >= context_length tokens, or an explicit max_new_tokens that with the prompt
  exceeds context_length, is a 400 (tokenizer_manager.py); the scheduler then caps every
  max_new_tokens to context_length - prompt - 2 (scheduler.py init_req_max_new_tokens, with
  max_req_len = context_length - 1). GET /v1/models reports context_length as max_model_len.
- abort_request `{"rid", "abort_all"}`: a rid acts only when it names a request the server knows,
  exactly (then the scheduler matches by prefix); aborted requests answer normally (HTTP 200) with
  what they produced and the abort finish_reason. pause_generation `{"mode"}`: abort (default) |
  retract | in_place; while paused new requests wait before the scheduler, out of abort_all's reach
  (see `server.Admission`); continue_generation resumes.
- Weight updates answer `{"success", "message"}` (200 or 400). update_weight_version `{"new_version",
  "abort_all_requests": True}` answers `{"success", "message", "new_version"}`; update_weights_from_disk
  adds "num_paused_requests". get_weights_by_name `{"name", "truncate_size": 100}` returns
  `param.float().tolist()[:truncate_size]` (rows for a matrix). weight_version starts at "default".
- GET /model_info carries "weight_version"; /get_weight_version and /weight_version answer 404 with
  a pointer to /model_info (0.5.19, removed in 0.5.21). GET /server_info (and the deprecated
  /get_server_info) carries "version". GET /v1/loads -> {"timestamp", "version", "accelerator",
  "num_accelerators", "loads": [{"dp_rank", "num_running_reqs", "num_waiting_reqs", ...}]}; the
  deprecated GET /get_load -> [{"dp_rank", "num_reqs" (running + waiting), "num_waiting_reqs",
  "num_tokens", ...}] up to 0.5.20. /flush_cache (GET or POST) is 200 only with no request in flight.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from slime.engine_client.protocol import SUPPORTED_SGLANG as SUPPORTED_RELEASES


@dataclass(frozen=True)
class SglangRelease:
    """What differs between the SGLang releases the engine can mirror (each read from that wheel)."""

    version: str

    @property
    def _key(self) -> tuple[int, ...]:
        return tuple(int(part) for part in self.version.split("."))

    @property
    def weight_update_sessions(self) -> bool:
        """/begin_weight_update and /end_weight_update exist, and distributed/tensor updates need an
        open session (``managers/scheduler_components/weight_updater.py``, from 0.5.21)."""
        return self._key >= (0, 5, 21)

    @property
    def abort_once(self) -> bool:
        """Only the first ``abort_request`` of a rid is sent on to the scheduler (``abort_sent`` in
        ``managers/tokenizer_manager.py``, from 0.5.20)."""
        return self._key >= (0, 5, 20)

    @property
    def multimodal_0_5_23(self) -> bool:
        """Two image-prompt changes read in 0.5.23 and absent from 0.5.19 (0.5.20-0.5.22, not unpacked
        here, are taken as 0.5.19): more image placeholders than images is a ValueError naming both
        counts, HTTP 400 (``_placeholder_mismatch_error`` in ``multimodal/processors/base_processor.py``;
        0.5.19's ``legacy_load_mm_data`` raises a RuntimeError, which the HTTP server answers 500), and
        a text ``<image>`` counts as a placeholder (``qwen_vl.py``'s ``image_token_regex``)."""
        return self._key >= (0, 5, 23)

    @property
    def get_load(self) -> bool:
        """The deprecated ``GET /get_load`` shim over /v1/loads (``entrypoints/http_server.py``, up to
        0.5.20)."""
        return self._key <= (0, 5, 20)


def release(version: str) -> SglangRelease:
    if version not in SUPPORTED_RELEASES:
        raise ValueError(f"SGLang release {version} is not one of {', '.join(SUPPORTED_RELEASES)}")
    return SglangRelease(version)


# Sampling options SGLang has that this engine does not implement: accepted only at their neutral value.
_NEUTRAL_OPTIONS: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
    "beam_width": None,
}
# Options with no effect on a non-streaming single-process engine.
_IGNORED_OPTIONS = {"stream_interval", "custom_params", "spaces_between_special_tokens", "watermark"}


MULTIMODAL_UNSUPPORTED = "input_embeds and multimodal inputs are not supported by the torch engine"


class ProtocolError(ValueError):
    """A request the engine must refuse; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class UnhandledError(ProtocolError):
    """A failure SGLang's HTTP server does not catch (a RuntimeError where only ValueError is caught):
    Starlette answers it 500 with the plain text ``Internal Server Error``; the message is only logged."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=500)


def error_body(message: str) -> dict[str, Any]:
    return {"error": {"message": message}}


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: set[int] = field(default_factory=set)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    # Whether max_new_tokens came from the caller (an explicit value is checked against the context).
    explicit_max_new_tokens: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> SamplingParams:
        raw = dict(raw or {})
        params = cls()
        for name, neutral in _NEUTRAL_OPTIONS.items():
            value = raw.pop(name, None)
            if value is not None and value != neutral:
                raise ProtocolError(f"sampling_params.{name}={value!r} is not supported by the torch engine")
        for name in _IGNORED_OPTIONS:
            raw.pop(name, None)
        for name in ("max_new_tokens", "min_new_tokens", "top_k", "sampling_seed"):
            if raw.get(name) is not None:
                value = raw.pop(name)
                if not isinstance(value, int) or isinstance(value, bool):
                    raise ProtocolError(f"sampling_params.{name} must be an integer, got {value!r}")
                setattr(params, name, value)
                if name == "max_new_tokens":
                    params.explicit_max_new_tokens = True
            else:
                raw.pop(name, None)
        for name in ("temperature", "top_p", "min_p"):
            if raw.get(name) is not None:
                value = raw.pop(name)
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise ProtocolError(f"sampling_params.{name} must be a number, got {value!r}")
                setattr(params, name, float(value))
            else:
                raw.pop(name, None)
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if raw.get(name) is not None:
                setattr(params, name, bool(raw.pop(name)))
            else:
                raw.pop(name, None)
        stop = raw.pop("stop", None)
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise ProtocolError(f"sampling_params.stop must be a string or a list of strings, got {stop!r}")
        params.stop = [s for s in (stop or []) if s]
        stop_ids = raw.pop("stop_token_ids", None) or []
        if not all(isinstance(t, int) for t in stop_ids):
            raise ProtocolError(f"sampling_params.stop_token_ids must be integers, got {stop_ids!r}")
        params.stop_token_ids = set(stop_ids)
        if raw:
            raise ProtocolError(f"unknown sampling_params: {sorted(raw)}")
        params.verify()
        return params

    def verify(self) -> None:
        """SGLang's SamplingParams.verify checks (same limits, same messages where it matters)."""
        if self.temperature < 0.0 or self.temperature != self.temperature:
            raise ProtocolError(f"temperature must be a non-negative finite number, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ProtocolError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ProtocolError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k != -1 and self.top_k < 1:
            raise ProtocolError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if self.min_new_tokens < 0:
            raise ProtocolError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}.")
        if self.max_new_tokens is not None:
            if self.max_new_tokens < 0:
                raise ProtocolError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
            if self.min_new_tokens > self.max_new_tokens:
                raise ProtocolError(
                    f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], "
                    f"got {self.min_new_tokens}."
                )


@dataclass
class GenerateInput:
    """One (un-batched) /generate request after parsing; `input_ids` is filled by tokenization."""

    rid: str
    text: str | None
    input_ids: list[int] | None
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    return_text_in_logprobs: bool
    image_data: list[Any] | None = None  # this request's images (see ``vision.py``), None without
    lora_path: str | None = None  # the name of the LoRA adapter to run with (SGLang names adapters so)
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0


def _pick(value: Any, index: int, batched: bool) -> Any:
    return value[index] if batched and isinstance(value, list) else value


def parse_generate(body: dict[str, Any]) -> tuple[list[GenerateInput], bool]:
    """Split a /generate body into single requests; returns `(requests, is_batch)`."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    if body.get("stream"):
        raise ProtocolError("stream=true is not supported by the torch engine; send a non-streaming request")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ProtocolError("Either text or input_ids should be provided.")
    if body.get("input_embeds") is not None:
        raise ProtocolError(MULTIMODAL_UNSUPPORTED)
    if text is not None:
        batched = isinstance(text, list)
        prompts = text if batched else [text]
        if not all(isinstance(t, str) for t in prompts):
            raise ProtocolError("text must be a string or a list of strings")
    else:
        if not isinstance(input_ids, list):
            raise ProtocolError("input_ids must be a list of token ids or a list of such lists")
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if batched else [input_ids]
        for ids in prompts:
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise ProtocolError("input_ids must be a list of token ids or a list of such lists")
    images = _normalize_image_data(body.get("image_data"), len(prompts), batched)
    adapters = _normalize_lora_paths(body.get("lora_path"), len(prompts), batched)
    return_routes, routes_start = _routed_experts_options(body)
    rid = body.get("rid")
    requests = []
    for i, prompt in enumerate(prompts):
        if batched:
            this_rid = rid[i] if isinstance(rid, list) else f"{rid}_{i}" if rid else uuid.uuid4().hex
        else:
            this_rid = rid if rid else uuid.uuid4().hex
        start = _pick(body.get("logprob_start_len"), i, batched)
        requests.append(
            GenerateInput(
                rid=str(this_rid),
                text=prompt if text is not None else None,
                input_ids=list(prompt) if text is None else None,
                params=SamplingParams.from_dict(_pick(body.get("sampling_params"), i, batched)),
                return_logprob=bool(_pick(body.get("return_logprob"), i, batched) or False),
                logprob_start_len=-1 if start is None else int(start),
                return_text_in_logprobs=bool(body.get("return_text_in_logprobs") or False),
                image_data=images[i],
                lora_path=adapters[i],
                return_routed_experts=return_routes,
                routed_experts_start_len=routes_start,
            )
        )
    return requests, batched


def _routed_experts_options(body: dict[str, Any]) -> tuple[bool, int]:
    """``return_routed_experts`` and ``routed_experts_start_len``: a bool and an int (SGLang's field
    types, one value for the whole batch); the start is checked against the prompt with the tokens."""
    wanted = body.get("return_routed_experts") or False
    start = body.get("routed_experts_start_len")
    start = 0 if start is None else start
    if not isinstance(wanted, bool):
        raise ProtocolError(f"return_routed_experts must be a boolean, got {wanted!r}")
    if not isinstance(start, int) or isinstance(start, bool):
        raise ProtocolError(f"routed_experts_start_len must be an integer, got {start!r}")
    return wanted, start


def check_routed_experts_start(start: int, prompt_tokens: int) -> None:
    """SGLang's checks of ``routed_experts_start_len`` (``Scheduler.handle_generate_request``,
    0.5.19-0.5.23), made whenever ``return_routed_experts`` is set, with or without the server flag:
    the request is aborted with HTTP 400 and this message."""
    if start < 0:
        raise ProtocolError(
            f"recv_req.routed_experts_start_len={start} is lower than 0. "
            "Please use a non-negative routed_experts_start_len."
        )
    if start > prompt_tokens:
        raise ProtocolError(
            f"recv_req.routed_experts_start_len={start} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={prompt_tokens}. Please use a smaller routed_experts_start_len."
        )


def _normalize_lora_paths(lora_path: Any, batch_size: int, batched: bool) -> list[str | None]:
    """Each request's adapter name: one string names it for every request of a batch, a list one
    per request (``GenerateReqInput._normalize_lora_paths``, 0.5.19-0.5.23; None entries: the base)."""
    if lora_path is None:
        return [None] * batch_size
    names = [lora_path] * batch_size if isinstance(lora_path, str) else lora_path
    if not isinstance(names, list) or not all(n is None or isinstance(n, str) for n in names):
        raise ProtocolError("lora_path should be a list or a string.")
    if not batched and len(names) == 1:
        return names
    if len(names) != batch_size:
        raise ProtocolError(f"lora_path list length ({len(names)}) must match batch size ({batch_size})")
    return list(names)


def _normalize_image_data(image_data: Any, batch_size: int, batched: bool) -> list[list[Any] | None]:
    """Each request's images as SGLang 0.5.19-0.5.23 assign them (``GenerateReqInput._normalize_image_data``
    in ``managers/io_struct.py`` for a batch; a single request's item or list, ``TokenizerManager``):
    one item goes to every request of a batch, a flat list gives one image per request, a list of
    lists a list each; an empty list (or ``[None]``) is no image. Parallel sampling (n > 1) is refused
    by this engine, so there is nothing to replicate."""
    if not batched:
        items = image_data if isinstance(image_data, list) else [image_data]
        return [items if image_data is not None and items and items != [None] else None]
    if image_data is None or image_data == []:
        return [None] * batch_size
    if not isinstance(image_data, list):
        return [[image_data]] * batch_size
    if len(image_data) != batch_size:
        raise ProtocolError("The length of image_data should be equal to the batch size.")
    if isinstance(image_data[0], list):
        return [items if items and items != [None] else None for items in image_data]
    return [[item] for item in image_data]


def finish_stop_token(token_id: int) -> dict[str, Any]:
    return {"type": "stop", "matched": token_id}


def finish_stop_str(matched: str) -> dict[str, Any]:
    return {"type": "stop", "matched": matched}


def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": length}


def finish_abort(message: str = "Aborted") -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def finish_abort_queued(message: str) -> dict[str, Any]:
    """An abort from the waiting queue: the tokenizer manager's two-key form (no status_code)."""
    return {"type": "abort", "message": message}
