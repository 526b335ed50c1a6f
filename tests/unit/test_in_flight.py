"""The pushes a client waits for before a call (tierps.client.in_flight.PendingPushes):
which senders a call on some tables has send and finish their pushes first."""

from __future__ import annotations

import gc
import threading

from tierps.client.in_flight import PendingPushes, mark_sender_thread


class Sender:
    """A push sender that counts the times it was asked to send and finish its pushes."""

    def __init__(self) -> None:
        self.waits = 0

    def wait_for_pushes(self) -> None:
        self.waits += 1


def test_a_call_waits_for_the_senders_of_its_tables_only() -> None:
    pending = PendingPushes()
    first, second, idle = Sender(), Sender(), Sender()
    pending.add(["a", "b"], first)
    pending.add(["c"], second)
    pending.add(["b"], first)  # again: still one sender, waited for once a call
    pending.add([], idle)  # no table: never waited for
    pending.wait(["b", "a", "b"])
    assert (first.waits, second.waits) == (1, 0)
    pending.wait(["c", "d"])
    assert (first.waits, second.waits) == (1, 1)
    pending.wait(["d"])
    assert (first.waits, second.waits) == (1, 1)
    pending.wait()  # any table: every sender with a table
    assert (first.waits, second.waits, idle.waits) == (2, 2, 0)


def test_a_sender_that_is_gone_is_forgotten() -> None:
    pending = PendingPushes()
    kept, gone = Sender(), Sender()
    pending.add(["a"], kept)
    pending.add(["a"], gone)
    del gone
    gc.collect()
    pending.wait(["a"])
    assert kept.waits == 1
    assert len(pending._senders) == 1


def test_a_senders_own_thread_waits_for_nothing() -> None:
    pending = PendingPushes()
    sender = Sender()
    pending.add(["a"], sender)

    def on_sender_thread() -> None:
        mark_sender_thread()
        pending.wait(["a"])
        pending.wait()

    thread = threading.Thread(target=on_sender_thread)
    thread.start()
    thread.join()
    assert sender.waits == 0
