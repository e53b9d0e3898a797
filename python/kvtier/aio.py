"""The asyncio client: the same methods as :class:`kvtier.Client`, each a
coroutine. Calls run on the package's own runtime threads and complete the
awaiting task through the event loop, so the loop never blocks and many
calls can be in flight at once."""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from .client import Steps, T, _Api
from .types import ShmRegion


class AsyncClient(_Api):
    """An asyncio client of one kvtier server, for one tenant; arguments as
    for :class:`kvtier.Client`.

    >>> client = kvtier.AsyncClient("http://127.0.0.1:50051")
    >>> pages = await client.fetch("req-1", layer=0)
    """

    async def _call(self, method: str, request: Any, gather: bool = False) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(result: Any, error: Optional[BaseException]) -> None:
            if future.cancelled():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        def done(result: Any, error: Optional[BaseException]) -> None:
            # Called on a runtime thread: hand the result to the loop's,
            # unless the loop is gone (nobody waits any more).
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:
                pass

        pending = self._conn.call(method, request, done, incarnation=self.incarnation, gather=gather)
        try:
            return await future
        except asyncio.CancelledError:
            # Stop the call too (a request already sent may still apply:
            # appends take `position` for safe retries).
            pending.cancel()
            raise

    async def _run(self, steps: Steps[T]) -> T:  # type: ignore[override]
        try:
            rpc = next(steps)
            while True:
                try:
                    if rpc.via is not None:
                        # The region's connection blocks: off the event loop,
                        # on the region's own thread.
                        region = rpc.via
                        loop = asyncio.get_running_loop()
                        reply = await loop.run_in_executor(
                            region._executor(), region._call, rpc.method, rpc.request, rpc.gather, rpc.views
                        )
                    else:
                        reply = await self._call(rpc.method, rpc.request, rpc.gather)
                except Exception as e:  # let the method see its RPC's failure
                    rpc = steps.throw(e)
                else:
                    rpc = steps.send(reply)
        except StopIteration as done:
            return done.value

    async def register_shm(self, size: int, socket: Optional[str] = None) -> ShmRegion:
        """As :meth:`kvtier.Client.register_shm`, off the event loop."""
        native = await asyncio.get_running_loop().run_in_executor(
            None, self._conn.register_shm, socket or self.shm_socket, size, self.tenant
        )
        return ShmRegion(native, self._conn)

    async def close(self) -> None:
        """Closes the connection (when the last client sharing it goes)."""
        self._conn = None  # type: ignore[assignment]

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
