"""devpickle.Future shared by many threads at once (docs/PYTHON.md, "Threads
and the GIL": every method may be called from any thread).

Each race runs a harness that counts what the threads saw; the harness is
first run on a future that checks and completes without holding anything
between the two (a negative control), and must catch that race, or it
could not catch one in devpickle.Future either.
"""
import faulthandler
import gc
import threading
import time

import pytest

import devpickle

THREADS = 8
ROUNDS = 40


@pytest.fixture(autouse=True)
def hang_guard():
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


class RacyFuture:
    """A future whose completion checks, lets other threads run, then sets:
    two completions can both pass the check (the race the harness must see)."""

    def __init__(self):
        self._done = False
        self._value = None
        self._callbacks = []
        self._cv = threading.Condition()

    def set_result(self, value):
        if self._done:
            raise RuntimeError("Future can only be marked completed once")
        time.sleep(0.001)  # no lock held: another thread passes the check too
        self._value = value
        with self._cv:
            self._done = True
            callbacks, self._callbacks = self._callbacks, []
            self._cv.notify_all()
        for cb in callbacks:
            cb(self)

    def add_done_callback(self, cb):
        with self._cv:
            if not self._done:
                self._callbacks.append(cb)
                return
        cb(self)

    def wait(self):
        with self._cv:
            self._cv.wait_for(lambda: self._done)
        return self._value

    def done(self):
        return self._done


def race(make, rounds=ROUNDS):
    """THREADS threads at once on one future: half complete it (with their
    index), half add a callback and wait. Returns the first round's
    problems (several completions, a callback run other than once, a
    waiter or callback that saw another value than the winner's), or []."""
    for _ in range(rounds):
        f = make()
        start = threading.Barrier(THREADS)
        won, refused, seen, waited = [], [], [], []

        def completer(k):
            start.wait()
            try:
                f.set_result(k)
                won.append(k)
            except RuntimeError as e:
                refused.append(str(e))

        def consumer(k):
            start.wait()
            f.add_done_callback(lambda fut: seen.append((k, fut.wait())))
            waited.append(f.wait())

        threads = [threading.Thread(target=completer if k % 2 else consumer, args=(k,)) for k in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a thread did not finish"
        problems = []
        if len(won) != 1:
            problems.append(f"{len(won)} completions won: {won}")
        if any("only be marked completed once" not in r for r in refused):
            problems.append(f"refused otherwise: {refused}")
        consumers = sorted(k for k in range(THREADS) if k % 2 == 0)
        if sorted(k for k, _ in seen) != consumers:
            problems.append(f"callbacks ran for {sorted(k for k, _ in seen)}, not once each for {consumers}")
        if won and (any(v != won[0] for _, v in seen) or any(v != won[0] for v in waited)):
            problems.append(f"saw {seen} / {waited}, not the winner's {won[0]}")
        if problems:
            return problems
    return []


def test_the_race_harness_catches_two_completions_of_a_future_without_a_claim():
    # negative control: without a claim taken before the GIL can switch,
    # two set_result calls both complete
    assert race(RacyFuture, rounds=20)


def test_threads_completing_chaining_and_waiting_on_one_future_see_one_completion_and_each_callback_once():
    assert race(lambda: devpickle.Future(devices=[])) == []
    # the result walked (devices=None): the walk lets other threads in
    assert race(devpickle.Future) == []


def test_callbacks_that_release_the_gil_run_once_each_while_threads_add_more_and_wait():
    for _ in range(ROUNDS // 4):
        f = devpickle.Future(devices=[])
        children, ran = [], []
        start = threading.Barrier(THREADS + 1)

        def slow(fut):
            time.sleep(0.0005)  # the GIL goes to the adders and the waiters meanwhile
            ran.append(1)
            return fut.wait() + 1

        def adder():
            start.wait()
            for _ in range(4):
                children.append(f.then(slow))

        threads = [threading.Thread(target=adder) for _ in range(THREADS)]
        for t in threads:
            t.start()
        start.wait()
        f.set_result(1)
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a thread did not finish"
        assert devpickle.wait_all(children) == [2] * (4 * THREADS)
        assert len(ran) == 4 * THREADS


def test_collect_all_futures_made_and_chained_by_threads_while_their_inputs_complete_on_others():
    for _ in range(ROUNDS // 2):
        inputs = [devpickle.Future(devices=[]) for _ in range(4)]
        children = []
        start = threading.Barrier(6)

        def chain():
            start.wait()
            children.append(devpickle.collect_all(inputs).then(lambda agg: [f.value() for f in agg.value()]))

        def complete(fs, first):
            start.wait()
            for i, f in enumerate(fs, first):
                f.set_result(i)

        threads = [threading.Thread(target=chain) for _ in range(4)]
        threads += [threading.Thread(target=complete, args=(inputs[:2], 0))]
        threads += [threading.Thread(target=complete, args=(inputs[2:], 2))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a thread did not finish"
        assert [c.wait() for c in children] == [[0, 1, 2, 3]] * 4


def test_a_collect_all_future_in_a_cycle_with_its_callback_fails_its_children_while_threads_collect():
    # the collector runs on several threads while others drop such cycles:
    # every child fails with DP_ECANCELED, no callback ever runs
    ran, children = [], []
    stop = threading.Event()

    def collector():
        while not stop.is_set():
            gc.collect()

    def dropper():
        for i in range(ROUNDS):
            inputs = [devpickle.Future(devices=[]), devpickle.Future(devices=[])]
            if i % 2:  # a collect_all over a collect_all
                inputs = [devpickle.collect_all(inputs)]
            agg = devpickle.collect_all(inputs)
            agg.add_done_callback(lambda fut, agg=agg: ran.append(agg))
            children.append(agg.then(lambda fut: ran.append(fut)))
            del inputs, agg

    collectors = [threading.Thread(target=collector) for _ in range(2)]
    droppers = [threading.Thread(target=dropper) for _ in range(3)]
    for t in collectors + droppers:
        t.start()
    for t in droppers:
        t.join(60)
    stop.set()
    for t in collectors:
        t.join(60)
    gc.collect()
    assert len(children) == 3 * ROUNDS
    for c in children:
        assert c.done()
        with pytest.raises(devpickle.Error) as e:
            c.value()
        assert e.value.code == "DP_ECANCELED"
    assert ran == []


def test_ctrl_c_during_wait_all_raises_keyboard_interrupt_and_leaves_the_futures_as_they_were():
    # PYTHON.md: wait() takes the GIL back every 50 ms to run the signal
    # handlers, so Ctrl-C in the main thread raises KeyboardInterrupt from
    # wait() or wait_all(); a watchdog completes the futures late, so a
    # wait deaf to signals fails this test instead of hanging it.
    import os
    import signal

    futures = [devpickle.Future(devices=[]) for _ in range(3)]
    futures[0].set_result(0)
    watchdog = threading.Timer(10, lambda: [f.set_result("too late") for f in futures[1:]])
    ctrl_c = threading.Timer(0.1, os.kill, args=(os.getpid(), signal.SIGINT))
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    watchdog.start()
    start = time.monotonic()
    try:
        ctrl_c.start()
        with pytest.raises(KeyboardInterrupt):
            devpickle.wait_all(futures)
        elapsed = time.monotonic() - start
    finally:
        ctrl_c.join()
        signal.signal(signal.SIGINT, old)
        watchdog.cancel()
    assert elapsed < 5, elapsed
    assert [f.done() for f in futures] == [True, False, False]
    threading.Thread(target=lambda: [f.set_result(i) for i, f in enumerate(futures[1:], 1)]).start()
    assert devpickle.wait_all(futures) == [0, 1, 2]
