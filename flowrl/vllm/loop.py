"""One thread that owns a replica's vLLM engine, so that the requests of concurrent calls run in
the engine's one batch (continuous batching): a shard that arrives while another generates joins
its batch at the engine's next step instead of waiting for the first shard's longest answer."""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator


class _Call:
    """One call's requests and the future of their outputs, in the order the call gave them."""

    __slots__ = ("future", "outputs", "waiting")

    def __init__(self, n: int) -> None:
        self.future: Future[list[Any]] = Future()
        self.outputs: list[Any] = [None] * n
        self.waiting = n


class EngineLoop:
    """Runs ``engine.step()`` on a thread of its own while any request is unfinished; ``generate``
    adds a call's requests between two steps and waits for all of them.

    ``use`` runs a function on the engine while no step runs and no request is in flight (weights,
    sleep, the prefix cache); the replica calls it between steps only (``Model.merges_shards``).
    ``most_calls`` is the most calls whose requests shared one step: above 1, shards merged."""

    def __init__(self, engine: Any, on_thread: Callable[[], None] | None = None) -> None:
        self._engine = engine
        self._inbox: queue.SimpleQueue[tuple[list[Any], list[Any], _Call]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # the engine's one user at a time: the loop, or ``use``
        self._running: dict[str, tuple[_Call, int]] = {}  # request id -> its call, its place there
        self._ids = itertools.count()
        self._stopped: BaseException | None = None
        self._calls = 0  # calls with requests in the engine now
        self.most_calls = 0
        self._on_thread = on_thread
        self.thread = threading.Thread(target=self._run, name="flowrl-vllm", daemon=True)
        self.thread.start()

    def generate(self, prompts: list[Any], params: list[Any]) -> list[Any]:
        """The engine's outputs for ``prompts`` (one ``SamplingParams`` each), in their order."""
        if not prompts:
            return []
        if self._stopped is not None:
            raise self._error()
        call = _Call(len(prompts))
        self._inbox.put((prompts, params, call))
        if self._stopped is not None:  # it stopped meanwhile: nobody takes the call but us
            self._fail([])
        return call.future.result()

    def use(self, fn: Callable[[Any], Any]) -> Any:
        with self._lock:
            return fn(self._engine)

    def _run(self) -> None:
        try:
            if self._on_thread is not None:
                self._on_thread()
            while True:
                self._take(block=not self._running)
                self.most_calls = max(self.most_calls, self._calls)
                with self._lock:
                    outputs = self._engine.step()
                self._finish(outputs)
        except BaseException as err:  # every waiting call fails with it; none hangs
            self._stopped = err
            self._fail([call for call, _ in self._running.values()])
            raise

    def _fail(self, calls: list[_Call]) -> None:
        """Fails ``calls`` and those in the inbox with the loop's error."""
        while True:
            try:
                calls.append(self._inbox.get_nowait()[2])
            except queue.Empty:
                break
        for call in calls:
            if not call.future.done():
                call.future.set_exception(self._error())

    def _error(self) -> RuntimeError:
        err = self._stopped
        return RuntimeError(f"the vLLM engine's loop thread stopped: {type(err).__name__}: {err}")

    def _take(self, block: bool) -> None:
        """Adds the calls waiting in the inbox (waits for one if ``block``)."""
        while True:
            try:
                prompts, params, call = self._inbox.get(block=block)
            except queue.Empty:
                return
            self._calls += 1
            with self._lock:
                for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                    rid = f"r{next(self._ids)}"
                    self._running[rid] = (call, i)
                    self._engine.add_request(rid, prompt, p)
            block = False

    def _finish(self, outputs: list[Any]) -> None:
        for out in outputs:
            if not out.finished:
                continue
            call, i = self._running.pop(out.request_id)
            call.outputs[i] = out
            call.waiting -= 1
            if call.waiting == 0:
                self._calls -= 1
                call.future.set_result(call.outputs)


class StepLock:
    """Runs a merging policy's own Python (tokenizing, decoding, fields) one step at a time, for
    tokenizers and state that threads must not share; ``waiting()`` lets it go while the step
    waits for the engine, which is the part that concurrent steps share."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def __enter__(self) -> None:
        self._lock.acquire()
        self._owner = threading.get_ident()

    def __exit__(self, *exc: object) -> None:
        self._owner = None
        self._lock.release()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        if self._owner != threading.get_ident():  # not inside a step (a direct call)
            yield
            return
        self.__exit__()
        try:
            yield
        finally:
            self.__enter__()
