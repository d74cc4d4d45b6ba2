"""The SGLang-protocol generation engine in plain PyTorch + transformers (CPU or one CUDA GPU).

It stands in for the SGLang server where SGLang cannot run: rollout code talks to it over HTTP exactly
as to SGLang (same endpoints, request and reply shapes; see protocol.py for the facts matched).

Modules: `launcher` (the argv that starts it), `server_args` (CLI, SGLang flag names), `server`
(aiohttp endpoints), `engine` (request building, weight-update groups, memory state), `scheduler`
(continuous batching loop), `kv_cache` (slot KV cache), `model_runner` (HF model forwards),
`sampling` (pure sampling functions), `weights` (process group, tensor payload encoding, loading by
HF name).
"""
