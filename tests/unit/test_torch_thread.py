"""The shard's torch thread: everything given to it runs on one and the same thread."""

from __future__ import annotations

import threading

from conveyor.shard.service.torch_thread import TorchThread


async def test_every_call_runs_on_the_one_torch_thread() -> None:
    torch_thread = TorchThread()
    try:
        idents = {await torch_thread.run(threading.get_ident) for _ in range(5)}
        assert idents == {torch_thread.ident}
        assert torch_thread.ident != threading.get_ident()
    finally:
        torch_thread.shutdown()
