"""Asyncio front end of the engine: each request streams its deltas to its caller.

    engine = AsyncEngine.from_config(EngineConfig(model="path/to/hf-dir"))
    await engine.add_adapter("support-bot", "path/to/peft-dir")
    async for out in engine.generate("Hi", SamplingParams(max_tokens=32), adapter="support-bot"):
        print(out.delta_text, end="")
    await engine.stop()

Threading model
---------------
The :class:`~loramux.engine.engine.Engine` is not thread-safe, so exactly one thread
ever touches it: the *engine thread*, started by :meth:`AsyncEngine.start` (or lazily by
the first call that needs it). That thread owns the Engine and runs the step loop::

    until stopped:
        run the queued commands (blocking on the queue while the engine has no work)
        if the engine has unfinished requests: step(), hand each output to its stream

Callers are coroutines on any event loop, in any thread; they never call the Engine.
They put *commands* (add a request, abort one, add or remove an adapter, set a tenant
weight) on a thread-safe queue and await a :class:`concurrent.futures.Future` that the
engine thread resolves with the command's result or exception. Each request has a
*stream*: an :class:`asyncio.Queue` on its caller's event loop, which the engine thread
fills through ``loop.call_soon_threadsafe``. When the engine has nothing to do the thread
sleeps in a blocking ``get`` on the command queue (no spinning); the next command wakes
it. While requests run it drains the queue without blocking between steps.

Failures
--------
* A request the engine refuses (bad params, unknown adapter, over-long prompt, duplicate
  id) raises from :meth:`AsyncEngine.generate` before any output. Its stream is only
  registered once the engine accepted the request, so nothing is left behind.
* If a step raises, every in-flight request is aborted in the engine and its iterator
  raises :class:`AsyncEngineError` (``__cause__`` is the original error); the loop goes on.
* If the consumer stops iterating (``break``, ``aclose()``, its task cancelled, the client
  gone), the generator's ``finally`` queues an abort of its own stream. If the caller's
  event loop is already closed, the engine thread notices when it cannot deliver and
  aborts the request itself.
* :meth:`AsyncEngine.stop` lets the current step finish, aborts in-flight requests (their
  iterators raise :class:`EngineStoppedError`), fails queued commands the same way and
  joins the thread. A later :meth:`AsyncEngine.start` starts a fresh thread on the same
  Engine; a new thread only starts once the old one has exited.

The AsyncEngine must own its Engine: once started, nothing else may call the Engine.
``add_adapter`` parses the adapter on the engine thread (steps pause meanwhile);
``register_adapter`` does no work there: the engine's loader thread fetches and parses it
when a request first needs it, and the steps go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

from loramux.engine.config import EngineConfig
from loramux.engine.engine import Engine
from loramux.engine.isolation import EngineDown
from loramux.engine.lora.adapter import LoRARequest
from loramux.engine.lora.source import AdapterSource
from loramux.engine.outputs import RequestOutput
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.stats import EngineStats

logger = logging.getLogger(__name__)


class AsyncEngineError(RuntimeError):
    """The engine thread could not finish a request (a step failed, or it stopped)."""


class EngineStoppedError(AsyncEngineError):
    """The engine loop stopped (or is stopping) before the request or command finished."""


@dataclasses.dataclass
class _Stream:
    """Where one request's outputs go: a queue on its caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # items: RequestOutput, or an exception to raise

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Hand ``item`` over from the engine thread; False if the caller's loop is closed."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # "Event loop is closed": nobody is listening any more
            return False
        return True


def _detach(out: RequestOutput) -> RequestOutput:
    """A copy whose metrics the engine thread will not mutate while the caller reads them."""
    if out.metrics is None:
        return out
    metrics = dataclasses.replace(
        out.metrics, inter_token_times=list(out.metrics.inter_token_times)
    )
    return dataclasses.replace(out, metrics=metrics)


class _EngineLoop:
    """One engine thread's life: its command queue, its streams and the step loop.

    ``submit`` is called from any thread; every other method runs on the engine thread.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards `closed` against a racing submit()
        self.closed = False  # set once the loop no longer takes commands
        self._stop_requested = False  # engine thread only
        self.down: EngineDown | None = None  # why the engine can never step again
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self.thread = threading.Thread(target=self._run, name="loramux-engine", daemon=True)

    # --- any thread ------------------------------------------------------------------
    def submit(self, fn: Callable[[], Any]) -> Future:
        """Queue ``fn`` to run on the engine thread; the future gets its result."""
        future: Future = Future()
        with self._lock:
            if self.closed:
                raise EngineStoppedError("the engine loop has stopped")
            self._commands.put((fn, future))
        return future

    # --- commands (engine thread) ----------------------------------------------------
    def add_request(
        self, stream: _Stream, request_id: str, prompt, params, adapter, priority, tenant, mix
    ) -> None:
        try:
            self.engine.add_request(
                request_id,
                prompt,
                params,
                adapter=adapter,
                priority=priority,
                tenant=tenant,
                mix=mix,
            )
        finally:
            self.engine.step_interrupt.taken(priority)  # announced by generate()
        self._streams[request_id] = stream  # only once the engine has accepted it

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort by id (the public abort): the stream, if any, ends with the abort output."""
        stream = self._streams.pop(request_id, None)
        out = self.engine.abort(request_id)
        if stream is not None and out is not None:
            stream.put(_detach(out))
        return out

    def abort_stream(self, request_id: str, stream: _Stream) -> None:
        """Abort the request only if it still belongs to ``stream`` (its consumer left).

        Checking the stream, not just the id, keeps a generate() whose add failed (say, on
        a duplicate id) from aborting the other request that holds that id.
        """
        if self._streams.get(request_id) is stream:
            del self._streams[request_id]
            self.engine.abort(request_id)

    def request_stop(self) -> None:
        self._stop_requested = True

    # --- the loop (engine thread) ----------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop_requested:
                self._run_commands(block=not self.engine.has_work())
                if not self._stop_requested and self.engine.has_work():
                    self._step()
        finally:
            self._shutdown()

    def _run_commands(self, *, block: bool) -> None:
        """Run queued commands; with ``block``, sleep until at least one arrives."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return
        while True:
            self._execute(*command)
            if self._stop_requested:
                return
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    @staticmethod
    def _execute(fn: Callable[[], Any], future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return  # its caller gave up before it ran
        try:
            result = fn()
        except BaseException as exc:
            future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            future.set_result(result)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except EngineDown as exc:  # no step will ever run again: stop taking requests
            logger.error("the engine is down (%s); failing %d request(s)", exc, len(self._streams))
            self.down = exc
            self._fail_all(exc, AsyncEngineError(f"the engine is down: {exc}"))
            self._stop_requested = True
            return
        except Exception as exc:
            logger.exception("engine step failed; failing %d request(s)", len(self._streams))
            self._fail_all(exc, AsyncEngineError(f"engine step failed: {exc!r}"))
            return
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            if not stream.put(_detach(out)) and not out.finished:
                self.abort_stream(out.request_id, stream)

    def _fail_all(self, cause: BaseException | None, template: AsyncEngineError) -> None:
        """Abort every streamed request; each iterator raises its own copy of ``template``."""
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            try:
                self.engine.abort(request_id)
            except Exception:
                logger.exception("aborting %r failed", request_id)
            error = type(template)(*template.args)
            error.__cause__ = cause
            stream.put(error)

    def _shutdown(self) -> None:
        with self._lock:
            self.closed = True
        self._fail_all(None, EngineStoppedError("the engine loop stopped"))
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineStoppedError("the engine loop stopped"))


class AsyncEngine:
    """Streams requests through one :class:`Engine` run by a background thread.

    See the module docstring for the threading model.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock = threading.Lock()  # guards _loop across callers in different threads
        self._loop: _EngineLoop | None = None
        self._down: EngineDown | None = None  # kept once the loop that saw it is gone

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Build the Engine (loads the model; blocking) and wrap it."""
        return cls(Engine(config))

    # --- what it serves (fixed when the engine was built: safe from any thread) --------
    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def max_model_len(self) -> int:
        """The context cap: prompt plus output tokens of one request."""
        return self.engine.max_model_len

    @property
    def metrics_registry(self):
        """The Prometheus registry of the engine's metrics (collectors are thread-safe)."""
        return self.engine.metrics.registry

    # --- lifecycle -------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        loop = self._loop
        return loop is not None and not loop.closed and loop.thread.is_alive()

    @property
    def down(self) -> EngineDown | None:
        """Why the engine can never step again (a tensor-parallel rank died), or None."""
        loop = self._loop
        return self._down or (None if loop is None else loop.down)

    async def start(self) -> None:
        """Start the engine thread (idempotent; generate() and the others start it too)."""
        self._current_loop()

    async def stop(self) -> None:
        """Stop the engine thread: in-flight requests raise EngineStoppedError."""
        with self._lock:
            loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(EngineStoppedError):  # already stopping
            loop.submit(loop.request_stop)
        await asyncio.to_thread(loop.thread.join)
        with self._lock:
            self._down = self._down or loop.down
            if self._loop is loop:
                self._loop = None

    def _current_loop(self) -> _EngineLoop:
        with self._lock:
            loop, down = self._loop, self.down
            if down is not None:  # for good: no new loop
                raise EngineStoppedError(f"the engine is down: {down}")
            # Never two threads on one Engine: replace a loop only once its thread is gone.
            if loop is None or (loop.closed and not loop.thread.is_alive()):
                loop = self._loop = _EngineLoop(self.engine)
                loop.thread.start()
            return loop

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the engine thread and return its result."""
        future = self._current_loop().submit(partial(fn, *args, **kwargs))
        return await asyncio.wrap_future(future)

    # --- requests --------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | Seq[int],
        params: SamplingParams,
        *,
        adapter: str | None = None,
        priority: int = 0,
        tenant: str | None = None,
        request_id: str | None = None,
        mix: Seq[tuple[str, float]] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request: an output per step that gave it tokens, the last finished
        (a prompt-only request, ``max_tokens=0``, gets just its final output).

        Raises what ``Engine.add_request`` raises (before any output) if the request is
        refused. Leaving the loop early (break, aclose, cancellation) aborts the request.
        """
        if request_id is None:
            request_id = f"async-{uuid.uuid4().hex}"
        spec = getattr(params, "structured", None)  # add_request refuses a non-SamplingParams
        if spec is not None:
            # Compiled here, off the engine thread (a new schema takes milliseconds; the
            # first one also builds the compiler): the add below finds it in the cache.
            await asyncio.to_thread(self.engine.compile_structured, spec, tenant)
        loop = self._current_loop()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        finished = False
        try:
            add = partial(
                loop.add_request,
                stream,
                request_id,
                prompt,
                params,
                adapter,
                priority,
                tenant,
                mix,
            )
            # Before it queues behind the running step: a higher priority cuts that step short,
            # and so does any arrival during a lone prompt's solo step (scheduler policy 10).
            self.engine.note_arrival(priority)
            await asyncio.wrap_future(loop.submit(add))
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine thread already dropped the request
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                with contextlib.suppress(EngineStoppedError):  # stopping aborts them all anyway
                    loop.submit(partial(loop.abort_stream, request_id, stream))

    async def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request; its stream ends with a finished output (reason "abort").

        Returns that output, or None if no such request is unfinished.
        """
        loop = self._current_loop()
        return await asyncio.wrap_future(loop.submit(partial(loop.abort, request_id)))

    # --- pass-throughs, run on the engine thread ---------------------------------------
    async def add_adapter(self, name: str, path: str | Path) -> LoRARequest:
        return await self._call(self.engine.add_adapter, name, path)

    async def register_adapter(self, name: str, source: AdapterSource) -> LoRARequest:
        return await self._call(self.engine.register_adapter, name, source)

    async def remove_adapter(self, name: str) -> None:
        await self._call(self.engine.remove_adapter, name)

    async def adapter_residency(self) -> dict[str, str]:
        return await self._call(self.engine.adapter_residency)

    async def keep_adapter(self, name: str, keep: bool = True) -> None:
        await self._call(self.engine.keep_adapter, name, keep)

    async def pinned_adapters(self) -> dict[str, str]:
        return await self._call(self.engine.pinned_adapters)

    async def list_adapters(self) -> list[str]:
        return await self._call(self.engine.list_adapters)

    async def set_tenant_weight(self, tenant: str | None, weight: float) -> None:
        await self._call(self.engine.set_tenant_weight, tenant, weight)

    async def set_tenant_priority(self, tenant: str | None, priority: int) -> int:
        return await self._call(self.engine.set_tenant_priority, tenant, priority)

    async def has_unfinished_requests(self) -> bool:
        return await self._call(self.engine.has_unfinished_requests)

    async def stats(self) -> EngineStats:
        """``Engine.stats()``, taken on the engine thread between steps."""
        return await self._call(self.engine.stats)
