"""The torch engine hands finished replies from its scheduler thread to the HTTP loop in batches."""

from __future__ import annotations

import asyncio
import threading

from slime.backends.torch_engine.server import Replies


def test_a_wave_finished_in_one_step_wakes_the_loop_once_and_every_reply_reaches_its_request():
    async def scenario() -> tuple[list[dict], int, dict, bool]:
        loop = asyncio.get_running_loop()
        wakes = 0
        schedule = loop.call_soon_threadsafe

        def counted(*args):
            nonlocal wakes
            wakes += 1
            return schedule(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        replies = Replies()
        futures = [loop.create_future() for _ in range(128)]
        callbacks = [replies.callback(loop, future) for future in futures]
        gone = loop.create_future()
        gone_callback = replies.callback(loop, gone)
        gone.cancel()  # its client went away before the reply

        def scheduler_step() -> None:  # one decode step that finishes the whole wave
            for index, deliver in enumerate(callbacks):
                deliver({"index": index})
            gone_callback({"index": -1})

        thread = threading.Thread(target=scheduler_step)
        thread.start()
        thread.join()  # the loop was busy (here: blocked) for the whole step
        wave = await asyncio.gather(*futures)
        wakes_for_wave = wakes

        later = loop.create_future()
        threading.Thread(target=replies.callback(loop, later), args=({"index": 128},)).start()
        after = await asyncio.wait_for(later, timeout=5)
        return list(wave), wakes_for_wave, after, gone.cancelled()

    wave, wakes, after, gone_cancelled = asyncio.run(scenario())
    assert [reply["index"] for reply in wave] == list(range(128))
    assert wakes == 1
    assert after == {"index": 128}  # a reply after the drain wakes the loop again
    assert gone_cancelled
