"""The engine in its own thread, fed by a command queue.

HTTP handlers (asyncio) call submit() / abort(): both only put a command on a
queue.SimpleQueue and never touch the Engine. The engine thread drains the queue between
steps (blocking only while idle), runs Engine.step(), and hands each request's outputs to
its asyncio.Queue (one loop.call_soon_threadsafe per step). A failing step ends the requests it
ran with finish_reason "error" and the loop goes on; the server stays up."""
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


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    q: asyncio.Queue
    t_add: float
    t_last: Optional[float] = None
    n_out: int = 0
    n_prompt: int = 0


class EngineLoop:
    def __init__(self, engine, metrics=None, max_pending: int = 1024):
        self.engine = engine
        self.metrics = metrics
        self.max_pending = max_pending
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._pending = 0                   # submitted, not yet finished (HTTP side's count)
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

    def submit(self, request_id: str, prompt_ids: list, params, constraint=None) -> asyncio.Queue:
        """Queue a request -> the asyncio.Queue its Items arrive on (call from the event loop)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._pending += 1
        self._cmds.put(("add", request_id, prompt_ids, params, constraint, _Sink(loop, q, time.perf_counter(),
                                                                                  n_prompt=len(prompt_ids))))
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
                self._deliver(rid, Item([], finished=True, finish_reason="error", error=str(e)))
        elif kind == "abort":
            self.engine.abort(cmd[1])

    def _run(self):
        try:
            while not self._stop.is_set():
                busy = self.engine.has_unfinished()
                try:
                    cmd = self._cmds.get_nowait() if busy else self._cmds.get(timeout=0.5)
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    if cmd[0] == "stop":
                        return
                    self._handle(cmd)
                    try:
                        cmd = self._cmds.get_nowait()
                    except queue.Empty:
                        cmd = None
                if self.engine.has_unfinished():
                    self._step()
        finally:
            self.alive = False
            for rid in list(self._sinks):
                self._deliver(rid, Item([], finished=True, finish_reason="error", error="the engine stopped"))

    def _step(self):
        try:
            outs = self.engine.step()
        except Exception as e:  # noqa: BLE001
            log.exception("engine step failed; ending the requests in the engine")
            for rid in list(self._sinks):
                try:
                    self.engine.abort(rid)
                except Exception:  # noqa: BLE001
                    pass
            try:
                self.engine.step()  # reports (and frees) the aborted requests
            except Exception:  # noqa: BLE001
                pass
            for rid in list(self._sinks):
                self._deliver(rid, Item([], finished=True, finish_reason="error", error=f"engine error: {e}"))
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
            self._deliver(o.request_id, Item(list(o.token_ids), o.logprobs, o.top_logprobs, o.finished,
                                             o.finish_reason), batch)
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
