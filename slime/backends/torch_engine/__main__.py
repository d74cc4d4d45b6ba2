"""`python -m slime.backends.torch_engine --model-path DIR --host H --port P [SGLang server flags]`.

Starts the SGLang-protocol engine: loads the model, starts the scheduler thread, serves HTTP until
SIGTERM / SIGINT, then aborts what is in flight (callers get their partial outputs), closes the
weight-update groups and exits 0. Start-up problems are one line on stderr and exit status 2.
"""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from slime.backends.torch_engine.server_args import main_error, parse_server_args
    from slime.utils.startup import mark

    mark("engine server: process up")

    args = parse_server_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logger = logging.getLogger("slime.backends.torch_engine")

    from aiohttp import web
    from transformers.utils import logging as hf_logging

    from slime.backends.torch_engine.engine import TorchEngine
    from slime.backends.torch_engine.server import create_app

    mark("engine server: imports done")
    hf_logging.disable_progress_bar()
    if args.log_level != "debug":
        hf_logging.set_verbosity_error()
    for name, reason in args.ignored.items():
        logger.info("--%s has no effect in the torch engine: %s", name.replace("_", "-"), reason)
    try:
        engine = TorchEngine(args)
    except (OSError, ValueError, RuntimeError) as exc:
        main_error(f"cannot start the engine for {args.model_path}: {exc}")
    engine.start()
    mark("engine server: model loaded")
    logger.info(
        "torch engine serving %s on http://%s:%d (%s, %s, max_running_requests=%d, context_length=%d)",
        engine.model_path,
        args.host,
        args.port,
        engine.device,
        str(engine.runner.dtype).removeprefix("torch."),
        engine.max_running_requests,
        engine.context_length,
    )
    try:
        web.run_app(
            create_app(engine),
            host=args.host,
            port=args.port,
            print=None,
            access_log=logger if args.log_level == "debug" else None,
            handler_cancellation=True,
            shutdown_timeout=10.0,
        )
    except OSError as exc:
        engine.shutdown()
        main_error(f"cannot serve on {args.host}:{args.port}: {exc}")
    logger.info("torch engine stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
