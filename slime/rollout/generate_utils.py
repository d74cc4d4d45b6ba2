"""Building blocks of generate functions: one model turn through the router, appended to a ``Sample``.

A custom generate function (``--custom-generate-function-path``, ``async fn(args, sample,
sampling_params) -> Sample | list[Sample]``) is a loop of two kinds of appends to one sample:

- ``append_model_turn``: tokens the policy sampled, with the engine's log-probs, loss mask 1;
- ``append_env_output``: tokens the environment wrote (tool results, user turns), loss mask 0.

Both append token ids, never text, so ``sample.tokens`` is exactly what the engine saw and sampled and
the trainer scores it without re-tokenizing anything (text -> ids does not round-trip). A sketch::

    async def generate(args, sample, sampling_params):
        start_sample(args, sample)
        for _ in range(args.max_turns):
            turn = await generate_turn(args, sample.tokens, sampling_params | {"max_new_tokens": 64})
            append_model_turn(sample, turn)
            if turn.status is not Sample.Status.COMPLETED or not wants_tool(turn.text):
                break
            append_env_output(sample, env_token_ids(args, run_tool(turn.text)), run_tool(turn.text))
        return sample

A generate function may instead set ``sample.response`` alone (text, no tokens): ``complete_generated``
tokenizes it afterwards and it trains without engine log-probs (the retokenized ids may differ from
the ones the engine sampled, which is why the token form is preferred).

``generate_turn`` posts to the router of ``args`` (``slime.rollout.plugin_args.router_url``) on the
rollout's shared HTTP session, and once the rollout aborts (over-sampling finished, a weight update) it
answers ABORTED at once without sending anything, so loops end promptly.

Rollout routing replay (``--use-rollout-routing-replay``, R3): every request also asks for the experts
each token was routed to (``return_routed_experts``), and ``append_model_turn`` keeps them in
``sample.rollout_routed_experts``, one row per position but the last. The invariant (miles#3277): a
row and the log-prob it explains (row ``t`` routes the forward that gives the log-prob of token
``t + 1``) come from one forward. So a turn asks only for the rows the sample lacks
(``routed_experts_start_len``, ``route_request``), and where those rows explain log-probs the sample
already holds (a partial response resumed without its routes), the same request returns those
log-probs again (``logprob_start_len``); a reply whose request was retracted (``num_retractions``:
log-probs of its first decode, rows of its re-prefill) is scored again by one prefill-only request
(``rescore_turn``) whose log-probs and rows replace the turn's. sglang-router 0.3.2 drops the two
routed-experts fields when it re-serializes a request, so R3 requests go to an engine of the router
directly, in turn (``RolloutContext.engine_url``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import contextvars
import functools
import logging
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from slime.engine_client.generate import one_off_session, post_json
from slime.rollout.errors import RolloutError
from slime.rollout.plugin_args import (
    rollout_seed,
    routed_experts_shape,
    router_url,
    served_adapter,
    tokenizer_path,
)
from slime.rollout.prompt_files import render_chat
from slime.rollout.router import engine_urls
from slime.rollout.sample import Sample, routes_array
from slime.rollout.tokenizer_cache import load_tokenizer
from slime.rollout.vision import ImageError, check_expanded_length, png_data_url, vision_processor
from slime.utils.http import HttpError
from slime.utils.startup import mark

logger = logging.getLogger(__name__)

_FINISH_STATUS = {
    "stop": Sample.Status.COMPLETED,
    "length": Sample.Status.TRUNCATED,
    "abort": Sample.Status.ABORTED,
}

# R3 requests go to the router's engines directly (see the module docstring); their list is read again
# after this many seconds.
ENGINE_LIST_TTL_S = 5.0


@dataclass
class Turn:
    """One ``/generate`` reply, checked: the sampled ids with their log-probs and how it ended."""

    output_ids: list[int]
    log_probs: list[float]
    text: str
    status: Sample.Status
    weight_version: str
    finish_reason: dict[str, Any] = field(default_factory=dict)
    context_capped: bool = False
    """``max_new_tokens`` was cut to what the engine's context length left after the input."""
    num_retractions: int = 0
    """Times the engine retracted the request (its KV dropped and prefilled again)."""
    routed_experts: np.ndarray | None = None
    """R3: int32 ``[rows, layers, topk]``, positions ``routes_start ..`` of input + output but the last;
    None when the reply has none (aborted before it ran) or its rescore could not be sent."""
    routes_start: int = 0
    input_log_probs: list[float] | None = None
    """R3: log-probs of the input's tokens ``routes_start + 1 ..``, from the forward that routed them
    (``RouteRequest.rescore``), replacing those the sample held."""


@dataclass(frozen=True)
class RouteRequest:
    """What a turn asks of the engine's routed experts (``route_request``)."""

    start: int
    """``routed_experts_start_len``: the rows the sample holds already are not asked again."""
    rescore: bool = False
    """Rows from ``start`` on explain log-probs the sample holds from another forward: ask for those
    log-probs again (``logprob_start_len = start``), so both come from this request's forward."""


@dataclass
class RolloutContext:
    """What every generate call of one rollout shares: the HTTP session, the abort signal, and the
    rids of its requests still in flight.

    Every request carries a rid of its own (``<prefix>-<n>``), so the rollout knows which of its
    requests an engine still holds. That matters because SGLang's ``abort_all`` does not reach a
    request that arrived while the engine was paused (it waits before the scheduler and runs after
    ``/continue_generation``): the rollout only counts itself done once every rid has come back.
    """

    session: aiohttp.ClientSession
    context_length_lookup: Callable[[], int | None] | None = None
    """Reads the engines' context length, which caps every request's ``max_new_tokens``; called once,
    at the first request (a generate function that never calls the engines never needs it)."""
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight: set[str] = field(default_factory=set)
    retries: int = 0
    """``--use-fault-tolerance``: how often a request that an engine failed (HTTP 5xx through the router,
    a broken connection) is sent again, from the same tokens, before the rollout stops."""
    retry_wait_s: float = 1.0
    """The longest wait before a retry (doubling from 0.5 s): the health monitor needs about one
    probe interval to take a dead engine out of the router."""
    retried: int = 0
    prefix: str = field(default_factory=lambda: f"slime-{uuid.uuid4().hex[:12]}")
    _sent: int = 0
    _engines: list[str] = field(default_factory=list)
    _engines_read_at: float = 0.0
    _context_length: int | None = None
    _looked_up: bool = False
    _lookup_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def context_length(self) -> int | None:
        async with self._lookup_lock:  # once per rollout, however many requests start together
            if not self._looked_up and self.context_length_lookup is not None:
                self._context_length = await asyncio.to_thread(self.context_length_lookup)
            self._looked_up = True
        return self._context_length

    async def engine_url(self, router: str) -> str:
        """R3's target: the router's engines in turn, the list read again every ENGINE_LIST_TTL_S (an
        engine the health monitor took out drops out of it, a restarted one comes back)."""
        now = asyncio.get_running_loop().time()
        if not self._engines or now - self._engines_read_at > ENGINE_LIST_TTL_S:
            self._engines = await asyncio.to_thread(engine_urls, router)
            self._engines_read_at = now
            if not self._engines:
                raise RolloutError(f"the router at {router} has no engine to send an R3 request to")
        return self._engines[self._sent % len(self._engines)]

    def new_rid(self) -> str:
        """Fixed width, so no rid is a prefix of another request's (SGLang matches abort rids by prefix;
        within one batch ``<rid>_1`` is a prefix of ``<rid>_10``, which is aborted with it anyway)."""
        self._sent += 1
        return f"{self.prefix}-{self._sent:010d}"


_CONTEXT: contextvars.ContextVar[RolloutContext | None] = contextvars.ContextVar(
    "slime_rollout", default=None
)


@contextlib.contextmanager
def rollout_context(context: RolloutContext) -> Iterator[RolloutContext]:
    """Makes ``context`` the one ``generate_turn`` uses in this task and the tasks it starts."""
    token = _CONTEXT.set(context)
    try:
        yield context
    finally:
        _CONTEXT.reset(token)


@functools.cache
def cached_tokenizer(path: str) -> Any:
    """The ``--hf-checkpoint`` tokenizer, loaded once per process."""
    return load_tokenizer(path)


def prompt_ids(args: argparse.Namespace, sample: Sample) -> list[int]:
    """The prompt's token ids: chat messages are rendered with the chat template first.

    A prompt with images (``sample.multimodal_inputs``) goes through the checkpoint's processor: each
    image's placeholder becomes its image tokens, expanded (``slime.rollout.vision``), and
    ``sample.multimodal_train_inputs`` gets the processor's tensors. ``ImageError`` names an image that
    cannot be decoded."""
    path = tokenizer_path(args)
    tokenizer = cached_tokenizer(path)
    tools = sample.metadata.get("tools")
    prompt = sample.prompt if isinstance(sample.prompt, str) else render_chat(tokenizer, sample.prompt, tools)
    images = sample_images(sample)
    if images:
        processor = vision_processor(path)
        encoded = processor.encode(images)
        sample.multimodal_train_inputs = encoded.train_inputs()
        return processor.expand(processor.encode_text(prompt), encoded.token_counts)
    ids: list[int] = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return ids


def sample_images(sample: Sample) -> list[Any]:
    """The sample's image items so far (prompt and observations), in the order their tokens appear."""
    return list((sample.multimodal_inputs or {}).get("image") or [])


def request_images(args: argparse.Namespace, sample: Sample) -> list[str]:
    """A ``/generate`` request's ``image_data`` for ``sample``: every image so far, resized and encoded as
    the rollout's processor saw it. Fills ``multimodal_train_inputs`` where it is missing (a partial
    sample resumed from a saved buffer keeps its ids, not its tensors)."""
    images = sample_images(sample)
    if not images:
        return []
    processor = vision_processor(tokenizer_path(args))
    if sample.multimodal_train_inputs is None:
        sample.multimodal_train_inputs = processor.encode(images).train_inputs()
    return processor.data_urls(images)


def env_token_ids(args: argparse.Namespace, text: str) -> list[int]:
    """Token ids of text the environment adds (no special tokens added around it)."""
    tokenizer = cached_tokenizer(tokenizer_path(args))
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def start_sample(args: argparse.Namespace, sample: Sample) -> None:
    """Puts the prompt's ids in ``tokens`` unless already there (a resumed partial response keeps its own).
    A prompt image that cannot be decoded leaves the sample FAILED (``fail_on_image``): check
    ``sample.finished`` before generating."""
    if not sample.tokens:
        try:
            sample.tokens = prompt_ids(args, sample)
        except ImageError as error:
            fail_on_image([sample], error)


def fail_on_image(samples: list[Sample], error: ImageError) -> None:
    """Samples whose prompt images cannot be processed: FAILED (two-token stubs, never trained), named
    in a warning and in ``metadata["error"]``; the rollout goes on."""
    logger.warning("samples %s failed (not trained): %s", [s.index for s in samples], error)
    for sample in samples:
        sample.tokens = [0, 0]  # any two ids: a FAILED stub is never trained
        fail_without_response(sample, f"sample {sample.index}: {error}")


def remaining_tokens(sample: Sample, sampling_params: dict[str, Any]) -> int:
    """Response tokens still allowed: ``max_new_tokens`` is a budget for the whole (multi-turn) response."""
    budget: int = sampling_params["max_new_tokens"]
    return budget - sample.response_length


def parse_reply(reply: dict[str, Any], index: int | None = None) -> Turn:
    """A ``Turn`` from one SGLang ``/generate`` reply sent with ``return_logprob``; raises ``ValueError``
    when the reply lacks log-probs, they disagree with ``output_ids``, or the finish reason is unknown."""
    meta = reply["meta_info"]
    output_ids = list(reply["output_ids"])
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise ValueError("the /generate reply has no meta_info.output_token_logprobs; send return_logprob")
    if [t[1] for t in triples] != output_ids:
        raise ValueError(
            f"sample {index}: output_token_logprobs ids {[t[1] for t in triples]} differ from "
            f"output_ids {output_ids}"
        )
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in _FINISH_STATUS:
        raise ValueError(f"sample {index}: unknown finish_reason {finish!r}")
    return Turn(
        output_ids=output_ids,
        log_probs=[float(t[0]) for t in triples],
        text=reply.get("text", ""),
        status=_FINISH_STATUS[kind],
        weight_version=str(meta.get("weight_version")),
        finish_reason=finish if isinstance(finish, dict) else {"type": kind},
        num_retractions=int(meta.get("num_retractions") or 0),
    )


def routing_replay(args: argparse.Namespace) -> bool:
    """``--use-rollout-routing-replay``: every request asks for the routed experts."""
    return routed_experts_shape(args) is not None


def route_request(sample: Sample) -> RouteRequest:
    """What the next turn of ``sample`` asks of the routed experts: the rows from the first it lacks,
    and whether those rows explain response log-probs it already holds (a partial response whose
    routes were lost, e.g. retracted and then aborted in the waiting queue), to be asked again."""
    held = 0 if sample.rollout_routed_experts is None else len(sample.rollout_routed_experts)
    return RouteRequest(held, _explains_held_log_probs(sample, held))


def _explains_held_log_probs(sample: Sample, start: int) -> bool:
    """Whether rows from ``start`` on explain log-probs ``sample`` holds: those of its trained response
    tokens after position ``start``."""
    prompt, mask = sample.prompt_length, sample.loss_mask or []
    return sample.rollout_log_probs is not None and any(
        mask[position - prompt] for position in range(max(start + 1, prompt), len(sample.tokens))
    )


def decode_routed_experts(
    args: argparse.Namespace, reply: dict[str, Any], rows: int, index: int | None
) -> np.ndarray:
    """``meta_info["routed_experts"]`` as ``[rows, layers, topk]`` int32: SGLang's base64 of the int32
    ids, ``num_hidden_layers`` x ``num_experts_per_tok`` (``--num-layers`` x ``--moe-router-topk``)."""
    encoded = reply["meta_info"].get("routed_experts")
    if encoded is None:
        raise ValueError(
            f"sample {index}: the /generate reply has no meta_info.routed_experts; the engines must run "
            "with --enable-return-routed-experts (slime starts its own so under --use-rollout-routing-replay)"
        )
    shape = routed_experts_shape(args)
    assert shape is not None  # routes are asked for under --use-rollout-routing-replay only
    layers, topk = shape
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    if flat.size != rows * layers * topk:
        raise ValueError(
            f"sample {index}: meta_info.routed_experts holds {flat.size} expert ids, expected {rows} "
            f"positions x {layers} layers (--num-layers) x {topk} (--moe-router-topk)"
        )
    routes: np.ndarray = flat.reshape(rows, layers, topk).copy()
    return routes


def _take_routes(
    args: argparse.Namespace,
    turn: Turn,
    reply: dict[str, Any],
    ask: RouteRequest,
    sent: int,
    index: int | None,
) -> None:
    """The routes (and, with ``ask.rescore``, the re-scored input log-probs) of a reply to ``sent``
    input tokens. A reply aborted before its request ran has neither: the turn then holds no rows, and
    the sample's next turn asks for them again (``route_request``)."""
    turn.routes_start = ask.start
    meta = reply["meta_info"]
    scored = [entry[0] for entry in meta.get("input_token_logprobs") or []][1:]
    rescored = not ask.rescore or len(scored) == sent - 1 - ask.start
    if turn.status is Sample.Status.ABORTED and ("routed_experts" not in meta or not rescored):
        return
    turn.routed_experts = decode_routed_experts(
        args, reply, sent + len(turn.output_ids) - 1 - ask.start, index
    )
    if not rescored:
        raise ValueError(
            f"sample {index}: asked with logprob_start_len={ask.start}, the reply has {len(scored) + 1} "
            f"input log-probs for {sent} input tokens"
        )
    if ask.rescore:
        turn.input_log_probs = [float(value) for value in scored]


async def rescore_turn(
    args: argparse.Namespace,
    context: RolloutContext | None,
    input_ids: list[int],
    turn: Turn,
    ask: RouteRequest,
    images: list[str] | None,
    index: int | None,
) -> None:
    """A retracted turn (log-probs of its first decode, rows of its re-prefill), scored again: one
    prefill-only request of input + output (``max_new_tokens`` 0, log-probs and rows from
    ``ask.start``) whose log-probs and rows replace the turn's, both from its one forward. When the
    rollout aborts first, the turn keeps no rows (its sample asks for them when it resumes)."""
    turn.routed_experts = turn.input_log_probs = None
    if context is not None and context.aborted.is_set():
        return
    sequence = input_ids + turn.output_ids
    sent = _collapsed_inputs(args, [sequence], None if images is None else [images])[0]
    (reply,) = await _post_generate(
        args,
        context,
        [sent],
        {"max_new_tokens": 0},
        None if images is None else [images],
        RouteRequest(ask.start, True),
    )
    if reply is None:
        return
    scored = [float(entry[0]) for entry in reply["meta_info"]["input_token_logprobs"][1:]]
    if len(scored) != len(sequence) - 1 - ask.start:
        raise ValueError(
            f"sample {index}: the re-score of a retracted turn answered {len(scored)} log-probs for "
            f"positions {ask.start + 1}..{len(sequence) - 1}"
        )
    turn.routed_experts = decode_routed_experts(args, reply, len(sequence) - 1 - ask.start, index)
    split = len(scored) - len(turn.output_ids)
    turn.input_log_probs, turn.log_probs = scored[:split], scored[split:]


def sampling_seed(seed: int, index: int, prompt_length: int) -> int:
    """The request's own seed: from ``--rollout-seed``, the sample's index (indices continue across a
    resume) and how long the input is (each turn of a sample differs), never from which engine or batch
    it lands in. A resumed run so samples the same tokens as the uninterrupted one (the torch engine
    always; SGLang with deterministic inference on)."""
    return (seed * 1_000_003 + index * 65_537 + prompt_length) % 2**31


def _aborted_turn() -> Turn:
    return Turn([], [], "", Sample.Status.ABORTED, "", {"type": "abort"})


async def generate_turn(
    args: argparse.Namespace,
    input_ids: list[int],
    sampling_params: dict[str, Any],
    index: int | None = None,
    images: list[str] | None = None,
    routes: RouteRequest | None = None,
) -> Turn:
    """One model turn on ``input_ids`` through the router (ABORTED without a request once the rollout aborts).

    With the sample's ``index`` the request carries that sample's own ``sampling_seed`` (unless
    ``sampling_params`` has one). ``max_new_tokens`` <= 0 is answered TRUNCATED without a request:
    the budget is spent. Within a rollout it is first capped to the engines' context length minus the
    input (SGLang answers a request over it with HTTP 400, which would stop the run); a turn so capped
    is ``context_capped``, and one whose input alone fills the context is answered TRUNCATED without a
    request, its ``finish_reason`` saying so (``append_model_turn`` makes a sample left without a
    response token by it FAILED).

    With ``--use-rollout-routing-replay`` the turn carries its routed experts: ``routes`` is
    ``route_request(sample)`` of the sample ``input_ids`` are the tokens of (without it: all rows, from
    position 0, which is right for a sample without a response yet).
    """
    batch_images = None if images is None else [images]
    batch_routes = None if routes is None else [routes]
    turns = await generate_turns(
        args, [input_ids], sampling_params, indices=[index], images=batch_images, routes=batch_routes
    )
    return turns[0]


async def generate_turns(
    args: argparse.Namespace,
    inputs: list[list[int]],
    sampling_params: dict[str, Any],
    budgets: list[int] | None = None,
    indices: list[int | None] | None = None,
    images: list[list[str]] | None = None,
    routes: list[RouteRequest] | None = None,
) -> list[Turn]:
    """A model turn on each of ``inputs``, sent in SGLang's batch form (a list of ``input_ids``), so that
    a prompt group costs one HTTP request through the router instead of one per sample. On the engine
    each input is a request of its own (rid ``<batch rid>_<i>``): scheduled, aborted and answered as a
    single one. sglang-router 0.3.2 carries one ``sampling_params`` map and one rid per request, so
    the inputs share the parameters: a batch carries no per-sample ``sampling_seed``, while an input
    sent alone carries its sample's (with its index, unless the parameters have one), and inputs
    with different ``max_new_tokens`` (``budgets``, each input's own, else the parameters';
    then capped to the context length) go in separate requests. Capping and the answers without a
    request are ``generate_turn``'s; ``indices`` name the samples in errors.

    ``images`` (``request_images`` of each input's sample) go as SGLang's ``image_data`` with the
    inputs' image tokens collapsed to one per image (the engine expands them again); a reply whose
    prompt length differs from the expanded input raises ``ImageError`` (the engine resized otherwise).

    With ``--use-rollout-routing-replay`` each turn carries its routed experts (``routes``: each
    input's ``route_request``, default all rows; inputs asking differently go in separate requests, as
    SGLang takes one start for a whole batch), and a retracted one is scored again (``rescore_turn``).
    """
    context = _CONTEXT.get()
    if context is not None and context.aborted.is_set():
        return [_aborted_turn() for _ in inputs]
    limit = None if context is None else await context.context_length()
    turns: list[Turn | None] = [None] * len(inputs)
    batches: dict[tuple[int, RouteRequest | None], list[int]] = {}  # (max_new_tokens, routes) -> inputs
    asked = [sampling_params["max_new_tokens"]] * len(inputs) if budgets is None else budgets
    asks: list[RouteRequest | None] = [None] * len(inputs)
    if routing_replay(args):
        asks = list(routes) if routes is not None else [RouteRequest(0)] * len(inputs)
    sent = _collapsed_inputs(args, inputs, images)
    for i, input_ids in enumerate(inputs):
        if isinstance(sent[i], ImageError):
            turns[i] = Turn([], [], "", Sample.Status.FAILED, "", {"type": "error", "message": str(sent[i])})
            continue
        budget = asked[i]
        if limit is not None:
            budget = min(budget, max(limit - len(input_ids), 0))
        if budget <= 0:
            capped = budget < asked[i]
            reason: dict[str, Any] = {"type": "length"}
            if capped:
                reason["message"] = f"its {len(input_ids)} input tokens fill the context length of {limit}"
            turns[i] = Turn([], [], "", Sample.Status.TRUNCATED, "", reason, context_capped=capped)
        else:
            batches.setdefault((budget, asks[i]), []).append(i)

    async def send(budget: int, ask: RouteRequest | None, members: list[int]) -> None:
        params = {**sampling_params, "max_new_tokens": budget}
        index = None if indices is None or len(members) > 1 else indices[members[0]]
        if index is not None and "sampling_seed" not in params:
            params["sampling_seed"] = sampling_seed(rollout_seed(args), index, len(inputs[members[0]]))
        member_images = None if images is None else [images[i] for i in members]
        replies = await _post_generate(args, context, [sent[i] for i in members], params, member_images, ask)
        for i, reply in zip(members, replies, strict=True):
            if reply is None:  # the rollout aborted while the request waited for a retry
                turns[i] = _aborted_turn()
                continue
            index = None if indices is None else indices[i]
            if images is not None and images[i]:
                check_expanded_length(len(inputs[i]), reply, index)
            turn = turns[i] = parse_reply(reply, index)
            turn.context_capped = budget < asked[i]
            if ask is None:
                continue
            _take_routes(args, turn, reply, ask, len(inputs[i]), index)
            if turn.num_retractions and turn.output_ids:
                await rescore_turn(
                    args, context, inputs[i], turn, ask, None if images is None else images[i], index
                )

    await asyncio.gather(*(send(budget, ask, members) for (budget, ask), members in batches.items()))
    done = [turn for turn in turns if turn is not None]
    assert len(done) == len(turns)  # every input got its turn above
    return done


def _collapsed_inputs(
    args: argparse.Namespace, inputs: list[list[int]], images: list[list[str]] | None
) -> list[Any]:
    """What each input is sent as: with images, its image tokens collapsed to one per image (or the
    ``ImageError`` that makes its sample fail: a generated image token outside an image); else as is."""
    if images is None or not any(images):
        return list(inputs)
    processor = vision_processor(tokenizer_path(args))
    sent: list[Any] = []
    for ids, urls in zip(inputs, images, strict=True):
        try:
            sent.append(processor.collapse(ids, len(urls)))
        except ImageError as error:
            sent.append(error)
    return sent


async def _post_generate(
    args: argparse.Namespace,
    context: RolloutContext | None,
    inputs: list[list[int]],
    params: dict[str, Any],
    images: list[list[str]] | None = None,
    routes: RouteRequest | None = None,
) -> list[Any]:
    """The replies to one ``/generate`` of ``inputs`` (the single form for one), None each when the
    rollout aborted before a retry. With ``routes`` it asks for routed experts, from an engine
    directly (sglang-router 0.3.2 would drop the fields)."""
    mark("rollout: first /generate sent", once=True)
    batched = len(inputs) > 1
    payload: dict[str, Any] = {
        "input_ids": [list(ids) for ids in inputs] if batched else list(inputs[0]),
        "sampling_params": params,
        "return_logprob": True,
    }
    if images is not None and any(images):
        payload["image_data"] = images if batched else images[0]
    if (adapter := served_adapter(args)) is not None:
        payload["lora_path"] = adapter  # one name for the whole batch
    router = router_url(args)
    if routes is not None:
        payload.update(return_routed_experts=True, routed_experts_start_len=routes.start)
        if routes.rescore:
            payload["logprob_start_len"] = routes.start
    if context is not None:
        engines_of = router if routes is not None else None
        reply = await _post_with_retries(context, f"{router}/generate", payload, engines_of)
    else:
        async with one_off_session() as session:  # outside a rollout
            base = (await asyncio.to_thread(engine_urls, router))[0] if routes is not None else router
            reply = await post_json(session, f"{base}/generate", payload)
    if reply is None:
        return [None] * len(inputs)
    replies = reply if batched else [reply]
    if not isinstance(replies, list) or len(replies) != len(inputs):
        raise ValueError(f"/generate answered a batch of {len(inputs)} inputs with {reply!r:.200}")
    return replies


def _engine_failed(error: Exception) -> bool:
    """An answer a healthy engine would not give: a 5xx through the router, or no answer at all."""
    if isinstance(error, HttpError):
        return error.status >= 500
    return isinstance(error, aiohttp.ClientError | ConnectionError)


async def _post_with_retries(
    context: RolloutContext, url: str, payload: dict[str, Any], engines_of: str | None = None
) -> Any:
    """``/generate`` under a fresh rid per attempt, sent again ``context.retries`` times when an engine
    failed it; None when the rollout aborted meanwhile. The last failure is raised as it came.
    ``engines_of`` (a router): to its engines in turn (``RolloutContext.engine_url``) instead of ``url``.

    A batch (``input_ids`` a list of lists) gets one rid; SGLang names its requests ``<rid>_<i>``
    (``GenerateReqInput._normalize_rid``), and those are the rids tracked in flight and aborted."""
    inputs = payload["input_ids"]
    batch_size = len(inputs) if inputs and isinstance(inputs[0], list) else None
    attempt = 0
    while True:
        rid = payload["rid"] = context.new_rid()
        rids = [rid] if batch_size is None else [f"{rid}_{i}" for i in range(batch_size)]
        if engines_of is not None:
            url = f"{await context.engine_url(engines_of)}/generate"
        context.in_flight.update(rids)
        try:
            return await post_json(context.session, url, payload)
        except Exception as error:
            if attempt >= context.retries or not _engine_failed(error):
                raise
        finally:
            context.in_flight.difference_update(rids)
        context.retried += len(rids)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(context.aborted.wait(), min(0.5 * 2**attempt, context.retry_wait_s))
        if context.aborted.is_set():
            return None
        attempt += 1


def _check_response(sample: Sample) -> list[int]:
    """Fills what a response built by hand may lack before more is appended to it; returns its loss mask.

    Its loss mask becomes all ones (policy tokens). Its rollout log-probs stay ``None``: the engine's
    log-probs of those tokens are unknown, and a placeholder would be taken for a real one by TIS, MIS
    and the mismatch metrics. Such a sample keeps no rollout log-probs for its later turns either.
    """
    if sample.loss_mask is None:
        sample.loss_mask = [1] * sample.response_length
    if sample.rollout_log_probs is None and sample.response_length == 0:
        sample.rollout_log_probs = []
    return sample.loss_mask


def append_model_turn(sample: Sample, turn: Turn) -> None:
    """Appends a model turn: its ids, log-probs, text, loss mask 1, weight version; status from its end.
    With R3, its routed experts after the sample's first ``turn.routes_start`` rows (``_append_routes``)."""
    loss_mask = _check_response(sample)
    start = sample.response_length
    if turn.routed_experts is not None:
        _append_routes(sample, turn)
    sample.tokens += turn.output_ids
    sample.response += turn.text
    sample.response_length += len(turn.output_ids)
    loss_mask += [1] * len(turn.output_ids)  # in place: sample.loss_mask
    if sample.rollout_log_probs is not None:
        sample.rollout_log_probs += turn.log_probs
    if turn.output_ids:  # a turn that sampled nothing (aborted at once, no budget) holds no tokens to track
        sample.weight_versions.append(turn.weight_version)
        sample.turn_spans.append((start, sample.response_length))
    sample.status = turn.status
    if turn.status is Sample.Status.FAILED:  # the turn could not be sent (an image token out of place)
        reason = turn.finish_reason.get("message", "failed")
        logger.warning("sample %s failed (not trained): %s", sample.index, reason)
        sample.metadata.setdefault("error", reason)
    if turn.context_capped:
        sample.metadata["context_capped"] = True
    if sample.finished and not sample.response_length:  # e.g. a prompt that fills the context
        reason = turn.finish_reason.get("message", f"{turn.status.value} without a response token")
        fail_without_response(sample, reason)


def _append_routes(sample: Sample, turn: Turn) -> None:
    """Before the turn's tokens are appended: the sample's rows up to ``turn.routes_start`` and then the
    turn's, and the turn's re-scored input log-probs in place of the response log-probs it held. A turn
    whose rows would explain held log-probs of another forward is refused (it was sent without the
    sample's ``route_request``)."""
    assert turn.routed_experts is not None  # the caller's check
    if turn.input_log_probs is None and _explains_held_log_probs(sample, turn.routes_start):
        raise ValueError(
            f"sample {sample.index}: a turn's routed experts from position {turn.routes_start} route "
            "response tokens whose log-probs came from an earlier forward; send the turn with "
            "routes=route_request(sample) (slime.rollout.generate_utils)"
        )
    held = routes_array(sample.rollout_routed_experts)
    if held is None:
        held = np.zeros((0, *turn.routed_experts.shape[1:]), dtype=np.int32)
    rows = turn.routes_start + len(turn.routed_experts)
    if len(held) < turn.routes_start or rows != len(sample.tokens) + len(turn.output_ids) - 1:
        raise ValueError(
            f"sample {sample.index}: a turn's routed experts for positions {turn.routes_start}..{rows - 1} "
            f"do not continue the {len(held)} rows held for {len(sample.tokens)} tokens"
        )
    sample.rollout_routed_experts = np.concatenate([held[: turn.routes_start], turn.routed_experts])
    if turn.input_log_probs is None or sample.rollout_log_probs is None:
        return
    prompt = sample.prompt_length
    for position, value in enumerate(turn.input_log_probs, start=turn.routes_start + 1):
        if position >= prompt:
            sample.rollout_log_probs[position - prompt] = value


def fail_without_response(sample: Sample, reason: str) -> None:
    """Makes a finished sample that has no response token FAILED, carried by a two-token stub.

    The trainer scores response tokens: a sequence without one is refused (``check_train_data``), which
    stops the whole rollout, and ``--auto-resume`` would only replay the same stop. FAILED keeps the
    sample's place in its group, counts it in ``rollout/failed_ratio`` and leaves it out of the loss
    (loss mask 0) and out of its group's reward statistics. Its tokens become the prompt's first and
    last one, the last standing in as a response of loss mask 0 (log-prob placeholder 0.0, never read
    under a zero mask), so that it costs the trainer two positions: the whole prompt may be longer
    than the context and than ``--max-tokens-per-gpu``. ``metadata["error"]`` keeps ``reason``
    unless the sample already has one.
    """
    sample.tokens = [sample.tokens[0], sample.tokens[-1]]
    sample.multimodal_train_inputs = None  # the stub holds no image token
    sample.rollout_routed_experts = None  # R3: the train data gives a stub placeholder rows
    sample.response_length = 1
    sample.loss_mask = [0]
    if sample.rollout_log_probs is not None:
        sample.rollout_log_probs = [0.0]
    sample.status = Sample.Status.FAILED
    sample.metadata.setdefault("error", reason)


def append_env_output(sample: Sample, token_ids: list[int], text: str) -> None:
    """Appends environment output (tool result, user turn): loss mask 0, log-prob 0.0 placeholders
    (never read: every use of rollout log-probs is weighted by the loss mask)."""
    loss_mask = _check_response(sample)
    sample.tokens += token_ids
    sample.response += text
    sample.response_length += len(token_ids)
    loss_mask += [0] * len(token_ids)  # in place: sample.loss_mask
    if sample.rollout_log_probs is not None:
        sample.rollout_log_probs += [0.0] * len(token_ids)


def append_image_observation(args: argparse.Namespace, sample: Sample, text: str, images: list[Any]) -> None:
    """Appends an observation that shows images (loss mask 0, like ``append_env_output``): ``text`` with
    one ``<image>`` per item of ``images`` (paths, base64 strings, data URLs or PIL images), each
    expanded to its image tokens. The images join ``multimodal_inputs`` and their tensors
    ``multimodal_train_inputs``, so the next ``request_images`` sends all of them, as a multi-turn
    request to SGLang must."""
    items = [png_data_url(item) if hasattr(item, "save") else item for item in images]
    processor = vision_processor(tokenizer_path(args))
    earlier = sample_images(sample)
    if earlier and sample.multimodal_train_inputs is None:
        sample.multimodal_train_inputs = processor.encode(earlier).train_inputs()
    encoded = processor.encode(items)
    ids = processor.expand(processor.encode_text(text), encoded.token_counts)
    sample.multimodal_inputs = {**(sample.multimodal_inputs or {}), "image": earlier + items}
    new = encoded.train_inputs()
    if sample.multimodal_train_inputs is not None:
        import torch

        new = {key: torch.cat([sample.multimodal_train_inputs[key], value]) for key, value in new.items()}
    sample.multimodal_train_inputs = new
    append_env_output(sample, ids, text)


def complete_generated(args: argparse.Namespace, sample: Sample, plugin: str) -> None:
    """Checks a sample ``--custom-generate-function-path`` returned, completing the text form.

    The text form sets ``response`` and leaves the response tokens out (a generate that posts ``text``
    to the router): its response is tokenized after the prompt's ids, trained with loss mask 1 and no
    rollout log-probs, and marked COMPLETED unless the plugin set another finished status. A finished
    sample without a response token becomes FAILED (``fail_without_response``). A sample
    still PENDING otherwise would never be scored and its prompt group never finish, so it raises
    ``RolloutError`` naming the plugin and what it must set.
    """
    text_form = sample.response_length == 0 and bool(sample.response)
    if text_form and (sample.status == Sample.Status.PENDING or sample.finished):
        start_sample(args, sample)
        response_ids = env_token_ids(args, sample.response)
        sample.tokens += response_ids
        sample.response_length = len(response_ids)
        sample.loss_mask = [1] * len(response_ids)
        sample.rollout_log_probs = None
        if sample.status == Sample.Status.PENDING:
            sample.status = Sample.Status.COMPLETED
    if sample.finished and not sample.response_length:
        start_sample(args, sample)
        reason = f"--custom-generate-function-path {plugin} returned it {sample.status.value} without tokens"
        fail_without_response(sample, reason)
    if sample.status == Sample.Status.PENDING:
        raise RolloutError(
            f"--custom-generate-function-path {plugin} returned sample {sample.index} still pending "
            f"({sample.response_length} response tokens, {len(sample.response)} characters of response "
            "text): set sample.response to the response text, or append its tokens with "
            "slime.rollout.generate_utils.append_model_turn, and set sample.status (completed, "
            "truncated, aborted or failed)"
        )


def mask_offpolicy_turns(sample: Sample) -> int:
    """Zeroes the loss mask of turns sampled under another weight version than the last turn's.

    A partial rollout resumed after a weight update holds tokens of an older policy; these are not
    on-policy for the update that follows. Returns how many trained tokens were masked.
    """
    if not sample.turn_spans or sample.loss_mask is None:
        return 0
    latest = sample.weight_versions[-1]
    masked = 0
    for version, (start, end) in zip(sample.weight_versions, sample.turn_spans, strict=True):
        if version != latest:
            masked += sum(sample.loss_mask[start:end])
            sample.loss_mask[start:end] = [0] * (end - start)
    return masked
