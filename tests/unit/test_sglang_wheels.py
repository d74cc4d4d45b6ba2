"""Contract tests against SGLang's own source: the oldest and the newest release slime supports.

The Makefile unpacks the wheels of SGLang 0.5.19 and 0.5.23 without their (CUDA) dependencies into
``.venv/sglang-wheels/<version>``. Three checks read them, so that the next upstream change of shape
fails here and not in a user's first GPU run:

- the real ``ServerArgs`` of 0.5.23 (a ``msgspec.Struct``; ``sglang/srt/server_args.py``) is imported in
  a subprocess (``triton`` stubbed: it is a GPU package) and slime derives and checks ``--sglang-*``
  flags from it; every field slime controls or knows without SGLang is one of its flags;
- every field slime sends to an endpoint is a field of that endpoint's request struct
  (``sglang/srt/managers/io_struct.py``, ``sampling/sampling_params.py``), read with ``ast``;
- the routes slime relies on, and those the torch engine serves when it mirrors a release, are the
  ones that release's ``entrypoints/http_server.py`` and ``entrypoints/v1_loads.py`` register.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / ".venv" / "sglang-wheels"
RELEASES = ("0.5.19", "0.5.23")


def source(release: str) -> Path:
    root = WHEELS / release / "sglang" / "srt"
    if not root.is_dir():
        pytest.skip(f"SGLang {release} is not unpacked in {WHEELS} (make venv does it)")
    return root


# ---- ServerArgs ----------------------------------------------------------------------------------

# Imports the real ServerArgs with a stand-in for triton (any attribute, callable, decorator).
IMPORT_SERVER_ARGS = r"""
import dataclasses, importlib.abc, importlib.machinery, json, sys, types

class Anything:
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Anything()
    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else Anything()
    def __getitem__(self, key):
        return Anything()

class StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Anything()

class Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "triton":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        module = StubModule(spec.name)
        module.__path__, module.__version__ = [], "3.0.0"
        return module
    def exec_module(self, module):
        pass

sys.meta_path.insert(0, Stubs())
import sglang
from sglang.srt.server_args import ServerArgs
from slime.config import sglang_args as sa

flags = sa.derive_server_flags(ServerArgs)
source = sa.ServerArgsSource(ServerArgs, strict=True, origin=f"SGLang {sglang.__version__}")
typical = ["--sglang-mem-fraction-static", "0.8", "--sglang-enable-metrics", "--sglang-dtype", "bfloat16",
           "--sglang-context-length", "4096", "--sglang-attention-backend", "fa3"]
server_args, unknown = sa.collect_sglang_args(typical)
sa.check_sglang_server_args(server_args, source)
errors = {}
for bad in (["--sglang-no-such-flag", "1"], ["--sglang-tp-size", "2"], ["--sglang-dtype", "fp7"]):
    try:
        sa.check_sglang_server_args(sa.collect_sglang_args(bad)[0], source)
    except sa.ConfigError as error:
        errors[bad[0]] = error.line()
print(json.dumps({
    "version": sglang.__version__,
    "is_dataclass": dataclasses.is_dataclass(ServerArgs),
    "num_fields": len(sa.init_fields(ServerArgs)),
    "flags": sorted(flags),
    "fields": sorted({spec.field for spec in flags.values()}),
    "errors": errors,
}))
"""


def test_the_real_server_args_of_0_5_23_give_the_sglang_flags() -> None:
    root = source("0.5.23").parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_SERVER_ARGS], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["version"] == "0.5.23" and not found["is_dataclass"]  # a msgspec.Struct
    assert found["num_fields"] > 500
    from slime.config import sglang_args as sa

    fields = set(found["fields"])
    assert set(sa.SLIME_CONTROLLED) <= fields  # what slime sets per engine is still a server flag
    fallback = set(sa.init_fields(sa.FallbackServerArgs))
    assert fallback <= fields, f"the built-in subset names flags SGLang 0.5.23 lacks: {fallback - fields}"
    assert "is not a server flag of SGLang 0.5.23" in found["errors"]["--sglang-no-such-flag"]
    assert "is set by slime" in found["errors"]["--sglang-tp-size"]
    assert "'fp7' is not one of" in found["errors"]["--sglang-dtype"]


# ---- request structs -----------------------------------------------------------------------------


def function_source(path: Path, name: str) -> str:
    """The source of the (first) function or method ``name`` in ``path``, dedented: a release's own
    code, for the contract tests that run or read it."""
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return textwrap.dedent(ast.get_source_segment(text, node) or "")
    raise AssertionError(f"{name} is not in {path}")


def struct_fields(path: Path) -> dict[str, set[str]]:
    """Class name -> field names (annotated class attributes and ``__init__`` parameters), with the
    fields of base classes defined in the same file."""
    tree = ast.parse(path.read_text())
    own: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        names = {
            s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
        }
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                names |= {a.arg for a in item.args.args[1:] + item.args.kwonlyargs}
        own[node.name] = names
        bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def resolve(name: str) -> set[str]:
        return own.get(name, set()).union(*(resolve(base) for base in bases.get(name, [])))

    return {name: resolve(name) for name in own}


# What slime sends (slime/weight_sync, slime/rollout, slime/ray/session.py), by request struct.
SENT = {
    "GenerateReqInput": {"input_ids", "sampling_params", "return_logprob", "rid"},
    "UpdateWeightsFromDistributedReqInput": {
        "names", "dtypes", "shapes", "group_name", "load_format", "flush_cache", "weight_version",
    },
    "UpdateWeightsFromTensorReqInput": {
        "serialized_named_tensors", "load_format", "flush_cache", "weight_version",
    },
    "UpdateWeightFromDiskReqInput": {"model_path", "weight_version", "flush_cache", "abort_all_requests"},
    "InitWeightsUpdateGroupReqInput": {
        "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend",
    },
    "DestroyWeightsUpdateGroupReqInput": {"group_name"},
    "AbortReq": {"rid", "abort_all"},
    "PauseGenerationReqInput": {"mode"},
    "ReleaseMemoryOccupationReqInput": {"tags"},
    "ResumeMemoryOccupationReqInput": {"tags"},
}  # fmt: skip
SAMPLING_PARAMS_SENT = {
    "temperature", "top_p", "top_k", "max_new_tokens", "skip_special_tokens", "no_stop_trim",
    "stop", "stop_token_ids", "sampling_seed",
}  # fmt: skip


@pytest.mark.parametrize("release", RELEASES)
def test_every_field_slime_sends_is_a_field_of_the_releases_request_struct(release: str) -> None:
    root = source(release)
    structs = struct_fields(root / "managers" / "io_struct.py")
    for name, sent in SENT.items():
        assert name in structs, f"SGLang {release} has no {name}"
        assert sent <= structs[name], f"SGLang {release} {name} lacks {sent - structs[name]}"
    sessions = "BeginWeightUpdateReqInput" in structs
    assert sessions == (release >= "0.5.21")
    if sessions:
        assert "selector" in structs["BeginWeightUpdateReqInput"]
    sampling = struct_fields(root / "sampling" / "sampling_params.py")["SamplingParams"]
    assert sampling >= SAMPLING_PARAMS_SENT, SAMPLING_PARAMS_SENT - sampling


# ---- routes --------------------------------------------------------------------------------------

ROUTE = re.compile(r"\.(?:get|post|put|api_route)\(\s*\"(/[^\"]*)\"")
# The endpoints slime calls, and those whose presence tells releases apart.
RELEVANT = {
    "/generate", "/health", "/health_generate", "/server_info", "/get_server_info", "/model_info",
    "/get_model_info", "/abort_request", "/pause_generation", "/continue_generation", "/flush_cache",
    "/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_distributed",
    "/update_weights_from_tensor", "/update_weights_from_disk", "/get_weights_by_name",
    "/update_weight_version", "/release_memory_occupation", "/resume_memory_occupation",
    "/begin_weight_update", "/end_weight_update", "/v1/loads", "/get_load", "/get_weight_version",
    "/v1/models", "/weights_checker",
}  # fmt: skip


def served_routes(release: str) -> set[str]:
    entrypoints = source(release) / "entrypoints"
    text = (entrypoints / "http_server.py").read_text() + (entrypoints / "v1_loads.py").read_text()
    return set(ROUTE.findall(text)) & RELEVANT


@pytest.mark.parametrize("release", RELEASES)
def test_the_torch_engine_serves_the_routes_of_the_release_it_mirrors(release: str) -> None:
    from slime.backends.torch_engine import protocol, server

    real = served_routes(release)
    mirrored = {path for _, path, _ in server.ROUTES} | {
        path for _, path, _, serves in server.RELEASE_ROUTES if serves(protocol.release(release))
    }
    assert real == mirrored & RELEVANT, (
        f"only SGLang {release}: {real - mirrored}",
        f"only ours: {mirrored - real}",
    )
    assert ("/begin_weight_update" in real) == (release >= "0.5.21")
    assert ("/get_load" in real) == (release <= "0.5.20") and "/v1/loads" in real


def test_the_session_routes_take_post_only_so_the_probe_can_use_get() -> None:
    """``slime.engine_client.protocol`` tells a release with sessions by ``GET /begin_weight_update``
    answering 405 (the route exists, for POST only: FastAPI's answer) rather than 404, which opens
    nothing. That holds only while the routes are registered with ``@app.post``, as in 0.5.23."""
    text = (source("0.5.23") / "entrypoints" / "http_server.py").read_text()
    for path in ("/begin_weight_update", "/end_weight_update"):
        registrations = re.findall(rf"@app\.(\w+)\(\s*\"{path}\"", text)
        assert registrations == ["post"], (path, registrations)


@pytest.mark.parametrize("release", RELEASES)
def test_v1_models_reports_the_context_length_the_rollout_caps_by(release: str) -> None:
    """``slime.engine_client.control.context_length`` reads ``max_model_len`` of ``GET /v1/models``:
    a field of the release's ``ModelCard``, filled from the context length its tokenizer manager
    checks ``input + max_new_tokens`` against."""
    root = source(release)
    assert "max_model_len" in struct_fields(root / "entrypoints" / "openai" / "protocol.py")["ModelCard"]
    text = (root / "entrypoints" / "http_server.py").read_text()
    assert "max_model_len=_global_state.tokenizer_manager.model_config.context_len" in text
    manager = (root / "managers" / "tokenizer_manager.py").read_text()
    assert "(max_new_tokens + input_token_num) > _max_req_len" in manager


@pytest.mark.parametrize("release", RELEASES)
def test_max_running_requests_unset_is_the_servers_own_choice(release: str) -> None:
    """``--max-running-requests`` defaults to None in the release's ``ServerArgs`` and the model runner
    then takes the number its memory pool allows (``self.max_running_requests =
    result.max_running_requests``), so the torch engine picking its own default when the flag is
    unset (``DEFAULT_MAX_RUNNING_REQUESTS``, sized for a rollout) is what the flag means there."""
    root = source(release)
    # 0.5.19 declares the field in server_args.py; 0.5.23 moved it to its schedule argument group.
    declared = [root / "server_args.py", root / "arg_groups" / "fields" / "schedule.py"]
    text = "".join(path.read_text() for path in declared if path.is_file())
    assert re.search(r"max_running_requests: A\[\s*Optional\[int\],[^\]]*\]\s*= None", text)
    assert (
        "self.max_running_requests = result.max_running_requests"
        in (root / "model_executor" / "model_runner.py").read_text()
    )


@pytest.mark.parametrize("release", RELEASES)
def test_the_scheduler_caps_max_new_tokens_to_context_minus_input_minus_two(release: str) -> None:
    """The torch engine's cap (``engine.py``) and the rollout's TRUNCATED expectation rest on
    ``Scheduler.init_req_max_new_tokens``: ``min(max_new_tokens, max_req_len - input - 1)`` with
    ``max_req_len = min(context_len - 1, kv capacity - 1)`` (``tp_worker.py``)."""
    managers = source(release) / "managers"
    assert "self.max_req_len - input_len - 1" in (managers / "scheduler.py").read_text()
    assert "self.model_config.context_len - 1," in (managers / "tp_worker.py").read_text()


@pytest.mark.parametrize("release", RELEASES)
def test_a_prefix_hit_counts_at_most_all_but_the_last_input_token_as_cached(release: str) -> None:
    """The torch engine's ``cached_tokens`` for a request whose prompt it copied (``scheduler._prefill``)
    is the prompt less one token: ``Req``'s prefix match stops at ``input_len - 1`` so the last token is
    computed (``schedule_batch.py``), and ``cached_tokens`` adds up the matched tokens."""
    text = (source(release) / "managers" / "schedule_batch.py").read_text()
    assert "max_prefix_len = input_len - 1" in text
    assert "self.cached_tokens = 0" in text


@pytest.mark.parametrize("release", RELEASES)
def test_an_abort_by_rid_reaches_only_known_requests_and_from_0_5_20_only_once(release: str) -> None:
    """What the rollout's abort by rid (``RolloutClient.abort``) and its fall back to ``abort_all``
    rely on, in ``TokenizerManager``: ``generate_request`` registers a request (``_init_req_state``)
    before it waits out a pause, so a rid abort of a held request is forwarded to a scheduler that
    does not have it yet; ``abort_request`` drops a rid it does not know (one tokenizer worker); and
    from 0.5.20 on it forwards a rid's first abort only (``abort_sent``), so that abort is lost."""
    text = (source(release) / "managers" / "tokenizer_manager.py").read_text()
    generate = text[text.index("async def generate_request(") :]
    assert generate.index("self._init_req_state(obj") < generate.index("is_pause_cond.wait_for")
    abort = text[text.index("def abort_request(") :]
    abort = abort[: abort.index("async def pause_generation")]
    assert "tokenizer_worker_num == 1" in abort and "rid_to_state" in abort
    assert ("abort_sent" in abort) == (release >= "0.5.20")


@pytest.mark.parametrize("release", RELEASES)
def test_a_batch_with_one_rid_and_one_sampling_params_is_requests_named_rid_i(release: str) -> None:
    """What the rollout's batched ``/generate`` per prompt group (``generate_utils.generate_turns``)
    relies on, in ``GenerateReqInput`` (``managers/io_struct.py``): a string rid of a batch becomes
    ``f"{rid}_{i}"`` per input and one ``sampling_params`` dict is every input's; and
    ``TokenizerManager._init_req_state`` registers each input's rid, so the rollout can abort each
    by name (the torch engine's ``protocol.parse_generate`` names them the same way)."""
    root = source(release)
    io_struct = (root / "managers" / "io_struct.py").read_text()
    rid = io_struct[io_struct.index("def _normalize_rid(") :]
    rid = rid[: rid.index("\n    def ")]
    assert 'new_rids = [f"{self.rid}_{i}" for i in range(num)]' in rid
    params = io_struct[io_struct.index("def _normalize_sampling_params(") :]
    assert "self.sampling_params = [self.sampling_params] * num" in params[: params.index("\n    def ")]
    manager = (root / "managers" / "tokenizer_manager.py").read_text()
    init = manager[manager.index("def _init_req_state(") :]
    init = init[: init.index("\n    def ")]
    batch = init[init.index("else:") :]
    assert "obj.rid[i]," in batch and "obj[i]," in batch and "for i in range(len(obj.rid))" in batch
    assert "self.rid_to_state[rid] = " in init or "self.rid_to_state.update(new_states)" in init


@pytest.mark.parametrize("release", RELEASES)
def test_a_batch_answers_one_list_of_its_inputs_replies_in_order(release: str) -> None:
    """``generate_turns`` pairs the i-th reply with the i-th input and takes an aborted input's reply
    as a turn: ``TokenizerManager._handle_batch_request`` answers a non-streaming batch with
    ``_collect_batch_responses``, an ``asyncio.gather`` over the inputs' waiters in input order, and
    ``_handle_abort_finish_reason`` raises only for an abort that carries an error status (the
    rollout's aborts carry none, so their inputs answer normally and the batch with them)."""
    manager = (source(release) / "managers" / "tokenizer_manager.py").read_text()
    batch = manager[manager.index("async def _handle_batch_request(") :]
    batch = batch[: batch.index("\n    async def ", 10)]
    assert "outputs = await self._collect_batch_responses(generators)" in batch
    collect = manager[manager.index("async def _collect_batch_responses(") :]
    collect = collect[: collect.index("\n    async def ", 10)]
    assert "tasks = [asyncio.create_task(gen.__anext__()) for gen in generators]" in collect
    assert "return await asyncio.gather(*tasks)" in collect
    abort = manager[manager.index("async def _handle_abort_finish_reason(") :]
    abort = abort[: abort.index("\n    def ", 10)]
    assert 'finish_reason.get("status_code")' in abort


@pytest.mark.parametrize("release", RELEASES)
def test_health_generate_is_a_get_answering_200_or_503_with_no_body(release: str) -> None:
    """The fault-tolerance probe (``slime.ray.engines.engine_problem``) takes 200 for well and any
    other status, or no answer within its timeout, for failed: the route answers 200 once a generation
    came back and 503 while shutting down or when it did not (``entrypoints/http_server.py``)."""
    text = (source(release) / "entrypoints" / "http_server.py").read_text()
    body = text[text.index('@app.get("/health_generate")') :]
    body = body[: body.index("\n@app.")]
    assert "Response(status_code=200)" in body and "Response(status_code=503)" in body


@pytest.mark.parametrize("release", RELEASES)
def test_an_api_key_guards_every_endpoint_slime_calls_but_the_open_ones(release: str) -> None:
    """What the run's engine key relies on (``slime.ray.cluster.run_api_key``) and the torch engine's
    check mirrors (``server.OPEN_PATH_PREFIXES``): with only ``--api-key`` set, every endpoint needs
    ``Authorization: Bearer <key>`` (compared in constant time) or gets 401 ``{"error":
    "Unauthorized"}``; ``/health*`` and ``/metrics`` (and ``/ready`` from 0.5.23) stay open, and no
    route of ``http_server.py`` demands the admin key alone (``srt/utils/auth.py``)."""
    from slime.backends.torch_engine.server import OPEN_PATH_PREFIXES

    auth = (source(release) / "utils" / "auth.py").read_text()
    open_paths = [p for p in ("/health", "/ready", "/metrics") if f'path.startswith("{p}")' in auth]
    assert open_paths == (
        ["/health", "/ready", "/metrics"] if release >= "0.5.23" else ["/health", "/metrics"]
    )
    assert set(open_paths) <= set(OPEN_PATH_PREFIXES)  # the torch engine opens the newest release's set
    assert (
        'parts[0].lower() != "bearer"' in auth and "secrets.compare_digest(parts[1], expected_token)" in auth
    )
    assert '"Unauthorized"\n                            if decision.error_status_code == 401' in auth
    optional = auth[auth.index("if auth_level == AuthLevel.ADMIN_OPTIONAL:") :]
    assert "elif api_key:" in optional[: optional.index("# Normal endpoints")]
    server = (source(release) / "entrypoints" / "http_server.py").read_text()
    assert "AuthLevel.ADMIN_FORCE" not in server


@pytest.mark.parametrize("release", RELEASES)
def test_health_is_the_generating_probe_and_waits_while_paused(release: str) -> None:
    """Why slime starts sglang-router with its health checks off (``slime.rollout.router``) and the
    torch engine's ``/health`` generates: ``/health`` and ``/health_generate`` are one handler, a
    one-token generation unless ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` (default true) is off,
    failing after ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s) without output; and a generation waits while
    the engine is paused (``tokenizer_manager`` waits on ``is_pause_cond``)."""
    root = source(release)
    text = (root / "entrypoints" / "http_server.py").read_text()
    assert '@app.get("/health")\n@app.get("/health_generate")\nasync def health_generate(' in text
    assert 'HEALTH_CHECK_TIMEOUT = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))' in text
    body = text[text.index("async def health_generate(") :]
    body = body[: body.index("\n@app.")]
    assert "not envs.SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION.get()" in body
    assert '"max_new_tokens": 1' in body and "generate_request(gri, request)" in body
    assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION = EnvBool(True)" in (root / "environ.py").read_text()
    manager = (root / "managers" / "tokenizer_manager.py").read_text()
    assert "await self.is_pause_cond.wait_for(lambda: not self.is_pause)" in manager


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize(("model", "gate"), [("deepseek_v2", "MoEGate"), ("glm4_moe", "Glm4MoeGate")])
def test_the_expert_score_bias_is_a_gate_parameter_a_push_can_name(
    release: str, model: str, gate: str
) -> None:
    """slime pushes ``model.layers.N.mlp.gate.e_score_correction_bias`` by its HF name (DeepSeek-V3,
    GLM-4.5), and the torch engine takes it though transformers keeps it as a buffer: SGLang's gate
    holds it as a parameter, so its ``load_weights`` (``params_dict`` of ``named_parameters``) finds
    it (``models/deepseek_v2.py``, ``models/glm4_moe.py``)."""
    text = (source(release) / "models" / f"{model}.py").read_text()
    body = text[text.index(f"class {gate}(nn.Module):") :]
    body = body[: body.index("\nclass ")]
    assert "self.e_score_correction_bias = nn.Parameter(" in body
    assert f"self.gate = {gate}(" in text


@pytest.mark.parametrize("release", RELEASES)
def test_pause_and_continue_answer_status_ok_without_a_success_field(release: str) -> None:
    """What ``slime.engine_client.calls`` relies on when it reads ``success: false`` as a refusal
    (``entrypoints/http_server.py``): ``/pause_generation`` and ``/continue_generation`` answer 200 with
    ``{"message": ..., "status": "ok"}`` and no ``success`` key, so the check never refuses them."""
    text = (source(release) / "entrypoints" / "http_server.py").read_text()
    for handler in ("async def pause_generation(", "async def continue_generation("):
        body = text[text.index(handler) :]
        body = body[: body.index("\n@app.")]
        assert '"status": "ok"' in body and "status_code=200" in body, handler
        assert '"success"' not in body, handler


@pytest.mark.parametrize("release", RELEASES)
def test_destroying_a_weight_update_group_pops_it_and_destroys_its_process_group(release: str) -> None:
    """What the torch engine's ``/destroy_weights_update_group`` mirrors
    (``model_executor/model_runner_components/weight_updater.py``): the named group is popped and
    ``torch.distributed.destroy_process_group`` called on it; an unknown name is refused with "does
    not exist". The torch engine drops a group whose receive failed without waiting on it, and keeps
    that reply."""
    text = (source(release) / "model_executor" / "model_runner_components" / "weight_updater.py").read_text()
    body = text[text.index("def destroy_weights_update_group(") :]
    body = body[: body.index("\n    def ", 1)]
    assert "self._model_update_group.pop(group_name)" in body
    assert "torch.distributed.destroy_process_group(pg)" in body
    assert "Succeeded to destroy custom process group." in body and "does not exist" in body
    ours = (REPO / "slime" / "backends" / "torch_engine" / "update_groups.py").read_text()
    assert '"Succeeded to destroy custom process group."' in ours
    assert '"The group to be destroyed does not exist."' in ours


@pytest.mark.parametrize("release", RELEASES)
def test_the_weights_checker_actions_and_replies_the_torch_engine_mirrors(release: str) -> None:
    """``/weights_checker`` (``--check-weight-update-equal``): the three actions slime drives,
    ``"Success."`` on success (``scheduler_components/weight_updater.py``) and the comparison's
    error text (``utils/weight_checker.py``), as the torch engine answers them."""
    from slime.backends.torch_engine.weight_checker import ACTIONS

    checker = (source(release) / "utils" / "weight_checker.py").read_text()
    assert all(f'action == "{action}"' in checker for action in ACTIONS)
    assert 'raise Exception(f"check tensor equality failed:\\n" + "\\n".join(error_messages))' in checker
    updater = function_source(
        source(release) / "managers/scheduler_components/weight_updater.py", "check_weights"
    )
    assert 'success=True, message="Success."' in updater


# ---- routed experts (R3) -------------------------------------------------------------------------


def test_the_routed_experts_server_flag_is_a_boolean_off_by_default() -> None:
    """``--enable-return-routed-experts``: ``server_args.py`` in 0.5.19, ``arg_groups/fields/exec_.py``
    in 0.5.23 (the torch engine takes the same switch, ``server_args.HONOURED``)."""
    old = (source("0.5.19") / "server_args.py").read_text()
    new = (source("0.5.23") / "arg_groups" / "fields" / "exec_.py").read_text()
    flag = re.compile(r"enable_return_routed_experts: A\[\s*bool,[^\]]*\] = False")
    assert flag.search(old) and flag.search(new)
    from slime.backends.torch_engine.server_args import HONOURED

    assert "enable_return_routed_experts" in HONOURED


@pytest.mark.parametrize("release", RELEASES)
def test_routed_experts_request_fields_are_one_value_for_a_whole_batch(release: str) -> None:
    """``GenerateReqInput.return_routed_experts: bool`` and ``routed_experts_start_len: int`` (routes
    of positions ``[start, seqlen - 1)``, start in ``[0, prompt_tokens]``); a batch's requests get
    the same two values, never indexed (``__getitem__``), as the torch engine's ``protocol.py`` does."""
    io_struct = source(release) / "managers" / "io_struct.py"
    assert {"return_routed_experts", "routed_experts_start_len"} <= struct_fields(io_struct)[
        "GenerateReqInput"
    ]
    text = io_struct.read_text()
    assert "return_routed_experts: bool = False" in text and "routed_experts_start_len: int = 0" in text
    assert "`[routed_experts_start_len, seqlen - 1)`. Must be in [0, prompt_tokens]." in text
    assert "return_routed_experts=self.return_routed_experts,\n" in text
    assert "routed_experts_start_len=self.routed_experts_start_len,\n" in text


@pytest.mark.parametrize("release", RELEASES)
def test_a_bad_routed_experts_start_is_a_400_with_the_schedulers_message(release: str) -> None:
    """``Scheduler.handle_generate_request`` checks the start only with ``return_routed_experts`` (flag
    or not) and aborts the request with it; an abort of status 400 is raised as a ValueError, which
    the HTTP server answers 400 (``TokenizerManager``). The torch engine's messages are these."""
    from slime.backends.torch_engine.protocol import ProtocolError, check_routed_experts_start

    scheduler = (source(release) / "managers" / "scheduler.py").read_text()
    check = scheduler[scheduler.index("if recv_req.return_routed_experts:") :][:1200]
    assert "req.set_finish_with_abort(error_msg)" in check
    assert 'f"{recv_req.routed_experts_start_len=} is lower than 0. "' in check
    assert '"Please use a non-negative routed_experts_start_len."' in check
    assert 'f"{recv_req.routed_experts_start_len=} is higher than the "' in check
    assert 'f"number of input tokens {len(req.origin_input_ids)=}. Please "' in check
    assert 'f"use a smaller routed_experts_start_len."' in check
    with pytest.raises(
        ProtocolError, match=r"^recv_req\.routed_experts_start_len=-1 is lower than 0\. Please"
    ):
        check_routed_experts_start(-1, 7)
    with pytest.raises(ProtocolError) as high:
        check_routed_experts_start(8, 7)
    assert str(high.value) == (
        "recv_req.routed_experts_start_len=8 is higher than the number of input tokens "
        "len(req.origin_input_ids)=7. Please use a smaller routed_experts_start_len."
    )
    abort = function_source(source(release) / "managers" / "schedule_batch.py", "set_finish_with_abort")
    assert "status_code: int = HTTPStatus.BAD_REQUEST" in abort
    manager = (source(release) / "managers" / "tokenizer_manager.py").read_text()
    raised = r"BAD_REQUEST:?\n\s*(?:\):\n\s*if not is_stream:\n\s*)?"
    raised += r'raise ValueError\(finish_reason\["message"\]\)'
    assert re.search(raised, manager)


@pytest.mark.parametrize("release", RELEASES)
def test_routes_are_int32_rows_per_kv_slot_for_every_hidden_layer_zero_where_dense(release: str) -> None:
    """The capturer (``state_capturer/routed_experts.py``, ``base.py``): ``[num_hidden_layers,
    num_experts_per_tok]`` int32 per KV slot, zero-initialised, written at an MoE layer's index by
    the top-k it selects (``layers/moe/topk.py``) and never at a dense layer's; a request's rows are
    read through its KV slots, so a prefix-cache hit returns the rows recorded when the slot was
    computed; positions ``[min(start, seqlen - 1), seqlen - 1)``."""
    capturer = source(release) / "state_capturer"
    routed = (capturer / "routed_experts.py").read_text()
    assert "topk_size = model_config.hf_text_config.num_experts_per_tok" in routed
    assert "num_layers = model_config.hf_text_config.num_hidden_layers" in routed
    assert "if not get_exec().features.enable_return_routed_experts:\n            return None" in routed
    assert (
        'np.frombuffer(\n        pybase64.b64decode(routed_experts_base64.encode("utf-8")), dtype=np.int32'
        in routed
    )
    base = (capturer / "base.py").read_text()
    zeros = r"self\.buffer = torch\.zeros\(\s*\(max_batch_size, num_layers, topk_size\),\s*dtype=torch\.int32"
    assert re.search(zeros, base)
    assert "self.buffer[:batch, layer_id, :] = topk_indices" in base
    get_topk = function_source(capturer / "base.py", "get_topk")
    assert "start_len = min(start_len, seqlen - 1)" in get_topk
    assert "req_to_token_pool.req_to_token[req_pool_idx][start_len : seqlen - 1]" in get_topk
    assert "return self.host_cache.buffer[cache_pool_idx]" in get_topk
    assert (
        "capture_routed_experts_if_allowed(" in (source(release) / "layers" / "moe" / "topk.py").read_text()
    )


@pytest.mark.parametrize("release", RELEASES)
def test_a_finished_request_collects_its_routes_and_the_reply_has_them_as_base64(release: str) -> None:
    """``BatchResultProcessor._maybe_collect_routed_experts``: nothing without the server flag (no
    capturer: the reply has no ``routed_experts`` key, no error), else ``seqlen = prompt + output
    through the stop`` and the row count checked against ``seqlen - 1 - start``; the detokenizer
    base64-encodes the int32 bytes and the tokenizer manager sets ``meta_info["routed_experts"]``
    only when a request has them. A request aborted in the waiting queue is answered by
    ``_handle_abort_req`` without them, one aborted while running (``to_finish``) finishes as any other
    and has them; a retracted request drops its routes and has them read again from its slots after
    the re-prefill (``Req.reset_for_retract``)."""
    managers = source(release) / "managers"
    collect = function_source(
        managers / "scheduler_components" / "batch_result_processor.py", "_maybe_collect_routed_experts"
    )
    assert re.search(r"if capturer is None:\n\s*return\n", collect)
    assert "seqlen = len(req.origin_input_ids) + len(req.output_ids_through_stop)" in collect
    assert "expected_rows = max(0, seqlen - 1 - start_len)" in collect
    assert "routed_experts row-count mismatch" in collect
    encode = function_source(managers / "detokenizer_manager.py", "_b64_encode_per_request")
    assert 'pybase64.b64encode(item.numpy().tobytes()).decode("utf-8")' in encode
    manager = (managers / "tokenizer_manager.py").read_text()
    assert "if val is not None:" in manager and 'meta_info["routed_experts"] = val' in manager
    assert "routed_experts" not in function_source(managers / "tokenizer_manager.py", "_handle_abort_req")
    retract = function_source(managers / "schedule_batch.py", "reset_for_retract")
    assert "self.routed_experts = None" in retract
    # A running request aborted finishes through the same path, so its reply carries its rows.
    assert "# Abort method 3: set `to_finish`" in (managers / "scheduler.py").read_text()


@pytest.mark.parametrize("release", RELEASES)
def test_prompt_log_probs_from_a_start_bound_the_prefix_match_there(release: str) -> None:
    """A re-score (``generate_utils.rescore_turn``: ``logprob_start_len`` = the routes' start) gets its
    log-probs and its routes from one forward: with ``return_logprob`` the prefix match stops at
    ``logprob_start_len`` (``Req._compute_max_prefix_len``), so every position from there is computed."""
    text = (source(release) / "managers" / "schedule_batch.py").read_text()
    assert "max_prefix_len = min(max_prefix_len, self.logprob_start_len)" in text
