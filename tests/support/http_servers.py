"""A throwaway HTTP server for tests of HTTP clients."""

from __future__ import annotations


async def with_http_server(path: str, handler, body):
    """Serves ``handler`` at ``POST path`` on 127.0.0.1 (a free port) while ``body(url)`` runs; its result."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        return await body(f"http://127.0.0.1:{runner.addresses[0][1]}{path}")
    finally:
        await runner.cleanup()
