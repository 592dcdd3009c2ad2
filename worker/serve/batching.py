"""expert-worker's generation thread: continuous batching over the engine.

Requests arrive on a queue; the one thread that owns the engine loops: it admits waiting choices
while fewer than `max_batch` run (each gets a sequence of its own in the engine's arena), runs the
next pieces of the admitted prompts in one pass (`prefill_chunk` tokens in all, so that a long
prompt delays the others' next token by one piece, not by the whole prompt, and prompts that wait
together share a pass: Engine.mixed_step), then one decode step for every running choice: alone
through the engine's captured graph (Engine.forward), together through Engine.decode_batch, where
a layer's experts are fetched once for the union of the rows' picks. A choice that ends leaves at
once and its slot takes the next waiting one.

The running choices' next tokens are not run in the prompts' pass, though Engine.mixed_step can:
that pass is eager (its shapes vary), and each sequence's attention there costs launches and host
time that the captured decode step does not pay. On the H100 (bench/profile_batch.py --mixed,
Q3-12L, every expert cached), a 64-token prompt beside 16 running rows took 66.8 ms in one pass
against 31.6 ms for the prompt alone and then the 16-row step; four prompts of 50 tokens alone
and then the step, 81.0 ms.

A choice's tokens do not depend on its company beyond the steps' rounding: each row samples from
its own logits with its own sampler, and decode_batch's logits equal a sequence's own step's
within float32 rounding (Engine.decode_batch says where they are bit-equal); greedy tokens agree
unless two logits tie within that rounding (tests/worker/test_batch_scheduler.py).

A request's n choices are submitted one after another by its caller (api.py), so that one sampler
gives choice 0 what n=1 gives. A choice's usage is what it saw: its prefill time runs from its
admission to its first token (other choices' steps between its prompt's pieces included), and its
expert-cache counters are the engine's over its span, its company's lookups included."""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch

from .generation import Choice, Completion, Generator, Request, TokenLogprob, sync_device

log = logging.getLogger("expertpack.worker.batching")

PREFILL_CHUNK = 512  # prompt tokens a pass runs between two decode steps of the running choices


@dataclass
class _Job:
    req: Request
    on_text: Callable[[str], None] | None
    cancelled: Callable[[], bool]
    on_logprobs: Callable[[TokenLogprob], None] | None
    future: Future


class _Running:
    """A choice and its sequence, open until the choice ends."""

    def __init__(self, choice: Choice, job: _Job) -> None:
        self.choice = choice
        self.job = job

    def close(self, error: BaseException | None = None) -> None:
        """Gives the sequence back and the future its answer; a failure to finish the answer (a
        streaming sink whose event loop is gone) becomes the future's error, never the thread's."""
        self.choice.seq.close()
        if error is None:
            try:
                self.job.future.set_result(self.choice.completion())
                return
            except Exception as exc:
                error = exc
        self.job.future.set_exception(error)


@dataclass
class ThreadTimes:
    """Where the generation thread's time goes, for /metrics: what an operator reads to tell a
    batch bound by its GPU steps from one bound by the host work between them. Written by that
    thread only; read whole (a dict's copy is one operation under the GIL)."""

    steps: dict[int, int] = field(default_factory=dict)  # rows of a decode step -> steps run
    step_seconds: dict[int, float] = field(default_factory=dict)  # rows -> seconds, launch to logits ready
    token_seconds: float = 0.0  # sampling, stop checks, text and logprobs handed to the streams
    prompt_seconds: float = 0.0  # prompt passes, their first tokens included
    prompt_passes: int = 0  # passes of the admitted prompts' next pieces
    prompt_pieces: int = 0  # the pieces they ran: several a pass where prompts wait together

    def stepped(self, rows: int, seconds: float) -> None:
        self.steps[rows] = self.steps.get(rows, 0) + 1
        self.step_seconds[rows] = self.step_seconds.get(rows, 0.0) + seconds


class SchedulerStopped(RuntimeError):
    """The generation thread is not running (the server is shutting down, or it failed)."""


class BatchScheduler:
    """Runs submitted choices, up to `max_batch` at once, on its own thread (see the module). A
    failure ends the request it belongs to (a step's failure, the requests in that step); one
    outside any request stops the thread, failing every request it holds and every later one."""

    def __init__(self, generator: Generator, max_batch: int, prefill_chunk: int = PREFILL_CHUNK) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if max_batch > 1 and not getattr(generator.engine.model, "batched_decode", False):
            log.warning("%s runs one sequence a step: --max-batch %d taken as 1", generator.engine.files.arch,
                        max_batch)
            max_batch = 1
        self.generator = generator
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._gate = threading.Lock()  # a submit and the thread's end: no job queued after the last drain
        self._stopped = False
        self.times = ThreadTimes()
        self._running: list[_Running] = []
        self._ending: list[_Running] = []  # choices done at their last token, its text still to hand out
        self._admitting: list[_Running] = []  # prompts not yet run to their end, in arrival order
        self._thread = threading.Thread(target=self._main, name="generate", daemon=True)
        self._thread.start()

    def submit(self, req: Request, on_text: Callable[[str], None] | None = None,
               cancelled: Callable[[], bool] = lambda: False,
               on_logprobs: Callable[[TokenLogprob], None] | None = None) -> "Future[Completion]":
        """Queues a choice; its future gets the Completion (or the error that ended it)."""
        self.generator.check_fits(len(req.prompt_ids), req.max_tokens)
        future: Future = Future()
        with self._gate:
            if self._stopped or self._stopping.is_set():
                raise SchedulerStopped("the generation thread has stopped")
            self._jobs.put(_Job(req, on_text, cancelled, on_logprobs, future))
        return future

    def shutdown(self) -> None:
        """Stops taking choices, ends the running ones at their next token (as cancelled clients'
        end) and waits for the thread; choices still queued get an error."""
        self._stopping.set()
        self._jobs.put(None)
        self._thread.join()

    def _main(self) -> None:
        error: BaseException = SchedulerStopped("the server is shutting down")
        try:
            self._loop()
        except BaseException as exc:  # not a request's: nothing can be trusted to run on
            log.exception("the generation thread failed")
            error = SchedulerStopped(f"the generation thread failed: {exc!r}")
        finally:
            with self._gate:
                self._stopped = True
            for r in self._running + self._admitting + self._ending:
                r.close(error)
            self._running.clear()
            self._admitting.clear()
            self._ending.clear()
            self._fail_queued(error)

    def _loop(self) -> None:
        running, admitting = self._running, self._admitting
        while True:
            waiting = running or admitting
            # a choice done at its last token holds its sequence until its text is out (_ending)
            while len(running) + len(admitting) + len(self._ending) < self.max_batch and not self._stopping.is_set():
                try:
                    job = self._jobs.get(block=not waiting)
                except queue.Empty:
                    break
                if job is None:
                    break
                if job.future.set_running_or_notify_cancel():
                    opened = self._open(job)
                    if opened is not None:
                        admitting.append(opened)
                        waiting = True
            if self._stopping.is_set() and not running and not admitting:
                return
            if admitting:
                self._settle(running)  # the last step's text first: a prompt pass may take a while
                self._prefill(admitting, running)
            if running:
                self._step(running)
            if not running:  # no next step to hand the last one's text out beside
                self._settle(running)

    def _open(self, job: _Job) -> _Running | None:
        try:
            seq = self.generator.engine.new_sequence()
        except Exception as exc:
            job.future.set_exception(exc)
            return None
        cancelled = lambda: job.cancelled() or self._stopping.is_set()  # noqa: E731
        return _Running(Choice(self.generator, job.req, seq, job.on_text, cancelled, job.on_logprobs), job)

    def _prefill(self, admitting: list[_Running], running: list[_Running]) -> None:
        """The admitted prompts' next pieces in one pass (pieces: _pieces), or the first one's alone
        where there is one or the model cannot run several sequences' tokens together; a prompt
        run to its end joins the running. One piece runs as engine.forward runs it (a captured
        graph where its length has one); several, as Engine.mixed_step's runs."""
        engine = self.generator.engine
        pieces = self._pieces(admitting, running)
        if len(pieces) > 1 and not engine.mixes([r.choice.seq for r, _ in pieces]):
            pieces = pieces[:1]
        if not pieces:
            return
        start = time.perf_counter()
        try:
            if len(pieces) == 1:
                (r, piece), = pieces
                firsts = [engine.forward(piece, r.choice.seq, last=True)[-1]]
            else:
                firsts = list(engine.mixed_step([(r.choice.seq, piece) for r, piece in pieces], [], []))
        except Exception as exc:  # these requests' failure, not the others'
            log.exception("a prompt pass of %d prompts failed", len(pieces))
            for r, _ in pieces:
                admitting.remove(r)
                r.close(exc)
            return
        finally:
            self.times.prompt_seconds += time.perf_counter() - start
        self.times.prompt_passes += 1
        self.times.prompt_pieces += len(pieces)
        for (r, piece), first in zip(pieces, firsts):
            self._piece_done(r, piece, first, admitting, running)

    def _pieces(self, admitting: list[_Running], running: list[_Running]) -> list[tuple[_Running, list[int]]]:
        """The next pieces of the admitted prompts, the first admitted first, up to `prefill_chunk`
        tokens in all (the first prompt whole where nothing else runs), so that prompts waiting
        together share a pass and a long one delays the others' next token by one piece, not by
        the whole prompt. A prompt whose client left meanwhile leaves here."""
        pieces: list[tuple[_Running, list[int]]] = []
        budget = self.prefill_chunk
        for r in list(admitting):
            if budget <= 0:
                break
            piece = r.choice.next_piece(None if not running and not pieces else budget)
            if not piece:  # its client left while it waited
                self._piece_done(r, piece, None, admitting, running)
                continue
            pieces.append((r, piece))
            budget -= len(piece)
        return pieces

    def _step(self, running: list[_Running]) -> None:
        """One decode step of every running choice; the ones that end leave. The step is launched
        first, then the previous step's tokens are settled (their text handed out, stop strings
        looked for) while the GPU runs it; a choice a stop string ended has its row dropped. A
        failure of the step ends the choices in it; a failure of one row's sampling or sinks ends
        that row's."""
        engine = self.generator.engine
        start = time.perf_counter()
        try:
            if len(running) == 1:
                rows = [engine.forward([running[0].choice.token], running[0].choice.seq)[-1]]
            else:
                rows = list(engine.decode_batch([r.choice.seq for r in running], [r.choice.token for r in running]))
        except Exception as exc:
            self._settle(running)
            self._fail_step(running, exc)
            return
        launched = time.perf_counter()
        stepped = list(running)
        still = self._settle(running)  # the rows of choices a stop string ended are dropped
        live = [row for r, row in zip(stepped, rows) if r in still]
        settled = time.perf_counter()
        try:
            sync_device(rows[0].device)  # the step's own time, apart from the host's (sampling would wait as long)
            ready = time.perf_counter()
            greedy = [i for i, r in enumerate(running) if r.choice.req.sampler.greedy]  # one argmax for them
            chosen = dict(zip(greedy, torch.stack([live[i] for i in greedy]).argmax(-1).tolist())) if greedy else {}
        except Exception as exc:  # the step failed on the device: its choices end, not the thread
            self._fail_step(running, exc)
            return
        self.times.stepped(len(rows), launched - start + ready - settled)
        try:
            self._take(running, live, chosen)
        finally:
            self.times.token_seconds += settled - launched + time.perf_counter() - ready

    def _piece_done(self, r: _Running, piece: list[int], logits: torch.Tensor | None, admitting: list[_Running],
                    running: list[_Running]) -> None:
        """A step ran r's prompt piece (none: its client left): the last piece takes the first token
        and the choice joins the running; one that ended leaves."""
        try:
            if piece:
                r.choice.piece_done(piece, logits)
        except Exception as exc:  # this request's failure, not the others'
            log.exception("a prompt failed")
            admitting.remove(r)
            r.close(exc)
            return
        if r.choice.done:
            admitting.remove(r)
            r.close()
        elif r.choice.prefilled:
            admitting.remove(r)
            running.append(r)

    def _fail_step(self, running: list[_Running], exc: Exception) -> None:
        log.exception("a decode step of %d sequences failed", len(running), exc_info=exc)
        for r in running:
            r.close(exc)
        running.clear()

    def _settle(self, running: list[_Running]) -> list[_Running]:
        """Hands out the text of the last tokens taken; a choice that ends (a stop string, or done
        at its last token) leaves and closes. -> the running choices still running."""
        for r in [*running, *self._ending]:
            if not r.choice.unsettled:
                continue
            try:
                r.choice.settle()
            except Exception as exc:
                log.exception("a request's token failed")
                self._leave(r, running, exc)
                continue
            if r.choice.done:
                self._leave(r, running)
        return list(running)

    def _leave(self, r: _Running, running: list[_Running], error: BaseException | None = None) -> None:
        if r in running:
            running.remove(r)
        if r in self._ending:
            self._ending.remove(r)
        r.close(error)

    def _take(self, running: list[_Running], rows: list, chosen: dict[int, int]) -> None:
        """Each row's next token (`chosen` by row where the caller took it: the greedy rows'), its
        text left for the next step's launch; the choices that end leave, those with text to hand
        out after it."""
        for i, (r, row) in enumerate(list(zip(running, rows))):
            try:
                r.choice.take(row, chosen.get(i), settle=False)
            except Exception as exc:
                log.exception("a request's token failed")
                self._leave(r, running, exc)
                continue
            if r.choice.done:
                running.remove(r)
                if r.choice.unsettled:
                    self._ending.append(r)
                else:
                    r.close()

    def _fail_queued(self, error: BaseException) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(error)
