"""The engine in its own thread, fed by a command queue.

HTTP handlers (asyncio) call submit() / abort(): both only put a command on a
queue.SimpleQueue and never touch the Engine. The engine thread drains the queue between
steps (blocking only while idle), runs Engine.step(), and hands each request's outputs to
its asyncio.Queue (one loop.call_soon_threadsafe per step).

Failures stay with their request: a request the engine rejects, one whose output carries an
error (RequestOutput.error), and one whose constraint failed end with finish_reason "error"
and their own message; when Engine.step itself raises, the requests that step ran are
aborted with the error, the others go on, and the loop keeps running.

In-flight accounting: the HTTP side reserves a slot (reserve()) when it accepts a request,
before preparing it, so that a burst cannot exceed max_pending; the slot is released when
the request finishes (or by release() when it never reaches the engine)."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("deepfuse.serve")


@dataclass
class Item:
    """One request's news from one engine step."""
    token_ids: list
    logprobs: Optional[list] = None
    top_logprobs: Optional[list] = None
    finished: bool = False
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    status: int = 500                         # the HTTP status of error (400: the request's own fault)
    prompt_logprobs: Optional[list] = None    # [P] (position 0: None), on the first output after prefill
    prompt_top_logprobs: Optional[list] = None


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    q: asyncio.Queue
    t_add: float
    t_last: Optional[float] = None
    n_out: int = 0
    n_prompt: int = 0
    constraint: object = None


class EngineLoop:
    def __init__(self, engine, metrics=None, max_pending: int = 1024):
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"deepfuse.serve: max_pending must be an int >= 1, got {max_pending!r}")
        self.engine = engine
        self.metrics = metrics
        self.max_pending = max_pending
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._pending = 0                   # accepted (reserved), not yet finished
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deepfuse-engine", daemon=True)
        self.stats: dict = dict(engine.stats())  # a snapshot, refreshed by the engine thread
        self.stats.update(num_pending=0, tokens_per_s=0.0)
        self._tok_window: list[tuple[float, int]] = []
        self.alive = True

    # ------------------------------------------------------------------ HTTP side
    def start(self):
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 5.0):
        self._stop.set()
        self._cmds.put(("stop",))
        self._thread.join(timeout)

    @property
    def num_pending(self) -> int:
        return self._pending

    def overloaded(self) -> bool:
        return self._pending >= self.max_pending

    def reserve(self, n: int = 1) -> bool:
        """Take n in-flight slots at once, or none (False: the limit would be exceeded)."""
        with self._lock:
            if self._pending + n > self.max_pending:
                return False
            self._pending += n
            return True

    def release(self, n: int = 1):
        """Give back slots of requests that never reach submit()."""
        with self._lock:
            self._pending -= n

    def submit(self, request_id: str, prompt_ids: list, params, constraint=None) -> asyncio.Queue:
        """Queue a request on a slot taken by reserve() -> the asyncio.Queue its Items arrive on
        (call from the event loop)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._cmds.put(("add", request_id, prompt_ids, params, constraint,
                        _Sink(loop, q, time.perf_counter(), n_prompt=len(prompt_ids), constraint=constraint)))
        return q

    def abort(self, request_id: str):
        self._cmds.put(("abort", request_id))

    # ------------------------------------------------------------------ engine thread
    def _deliver(self, rid: str, item: Item, batch: Optional[dict] = None):
        """Hand item to its request; with batch, collect it (one loop wake-up per step: _flush)."""
        sink = self._sinks.get(rid)
        if sink is None:
            return
        if item.finished:
            if item.error is None and getattr(sink.constraint, "failed", False):
                item.finish_reason, item.status = "error", 500
                item.error = f"the output constraint failed: {sink.constraint.error}"
            del self._sinks[rid]
            with self._lock:
                self._pending -= 1
            if self.metrics is not None:
                self.metrics.finished(item.finish_reason or "unknown", sink.n_prompt, sink.n_out,
                                      time.perf_counter() - sink.t_add)
        if batch is not None:
            batch.setdefault(sink.loop, []).append((sink.q, item))
            return
        self._flush({sink.loop: [(sink.q, item)]})

    @staticmethod
    def _put_all(pairs):
        for q, item in pairs:
            q.put_nowait(item)

    def _flush(self, batch: dict):
        for loop, pairs in batch.items():
            try:
                loop.call_soon_threadsafe(self._put_all, pairs)
            except RuntimeError:  # the event loop is closed (shutdown)
                pass

    def _handle(self, cmd):
        kind = cmd[0]
        if kind == "add":
            _, rid, ids, params, constraint, sink = cmd
            self._sinks[rid] = sink
            try:
                self.engine.add_request(rid, ids, params, constraint=constraint)
            except Exception as e:  # noqa: BLE001 (a bad request must not stop the loop)
                self._deliver(rid, Item([], finished=True, finish_reason="error", error=str(e),
                                        status=400 if isinstance(e, ValueError) else 500))
        elif kind == "abort":
            try:
                self.engine.abort(cmd[1])
            except Exception:  # noqa: BLE001
                log.exception("engine abort failed")

    def _once(self) -> bool:
        """Drain the commands, run one step -> False on "stop"."""
        busy = self.engine.has_unfinished()
        try:
            cmd = self._cmds.get_nowait() if busy else self._cmds.get(timeout=0.5)
        except queue.Empty:
            cmd = None
        while cmd is not None:
            if cmd[0] == "stop":
                return False
            self._handle(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                cmd = None
        if self.engine.has_unfinished():
            self._step()
        return True

    def _run(self):
        try:
            while not self._stop.is_set():
                try:
                    if not self._once():
                        return
                except Exception as e:  # noqa: BLE001 (the loop outlives any error)
                    log.exception("engine loop error; ending the running requests")
                    for rid in self._in_step():
                        try:
                            self.engine.abort(rid)
                        except Exception:  # noqa: BLE001
                            pass
                        self._deliver(rid, Item([], finished=True, finish_reason="error",
                                                error=f"engine error: {type(e).__name__}: {e}"))
                    time.sleep(0.05)
        finally:
            self.alive = False
            for rid in list(self._sinks):
                self._deliver(rid, Item([], finished=True, finish_reason="error", error="the engine stopped"))

    def _in_step(self) -> list:
        """The requests a step runs: the scheduler's running ones (all of ours if unknown)."""
        try:
            running = [r.request_id for r in self.engine.scheduler.running]
        except Exception:  # noqa: BLE001
            running = None
        return [rid for rid in self._sinks if running is None or rid in running] or list(self._sinks)

    def _step(self):
        try:
            outs = self.engine.step()
        except Exception as e:  # noqa: BLE001
            log.exception("engine step failed; ending the requests it ran")
            failed = self._in_step()
            for rid in failed:
                try:
                    self.engine.abort(rid)
                except Exception:  # noqa: BLE001
                    pass
            for rid in failed:
                self._deliver(rid, Item([], finished=True, finish_reason="error",
                                        error=f"engine error: {type(e).__name__}: {e}"))
            return
        now = time.perf_counter()
        ntok = 0
        batch: dict = {}
        for o in outs:
            sink = self._sinks.get(o.request_id)
            if sink is not None and o.token_ids:
                n = len(o.token_ids)
                ntok += n
                if self.metrics is not None:
                    if sink.t_last is None:
                        self.metrics.ttft.observe(now - sink.t_add)
                    else:
                        self.metrics.itl.observe((now - sink.t_last) / n)
                sink.t_last = now
                sink.n_out += n
            err = getattr(o, "error", None)
            if err is not None or o.finish_reason == "error":
                item = Item(list(o.token_ids), finished=True, finish_reason="error",
                            error=str(err or "the request failed in the engine"),
                            status=400 if isinstance(err, ValueError) else 500)
                if not o.finished:  # ends here, whatever the engine does with it next
                    try:
                        self.engine.abort(o.request_id)
                    except Exception:  # noqa: BLE001
                        pass
            else:
                item = Item(list(o.token_ids), o.logprobs, o.top_logprobs, o.finished, o.finish_reason,
                            prompt_logprobs=getattr(o, "prompt_logprobs", None),
                            prompt_top_logprobs=getattr(o, "prompt_top_logprobs", None))
            self._deliver(o.request_id, item, batch)
        self._flush(batch)
        self._tok_window.append((now, ntok))
        while self._tok_window and now - self._tok_window[0][0] > 10.0:
            self._tok_window.pop(0)
        span = now - self._tok_window[0][0] if len(self._tok_window) > 1 else 0.0
        st = dict(self.engine.stats())
        st["num_pending"] = self._pending
        st["tokens_per_s"] = sum(n for _, n in self._tok_window[1:]) / span if span > 0 else 0.0
        self.stats = st
        if self.metrics is not None:
            self.metrics.update(st, ntok)
