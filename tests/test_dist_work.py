"""The backend's operation state (`dist/work.py`'s `_Op`), without a job:
completed once, its torch future made when first asked for (before or
after completion, with the result or the error), waiters released
together, a timeout failing it for good."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from gradhub.torch.dist.work import GradhubBackendError, Work, _Op  # noqa: E402


def test_a_future_asked_for_before_or_after_completion_carries_the_result():
    out = [torch.ones(3)]
    early = _Op("all_reduce", out)
    fut = early.future
    assert not fut.done() and not early.done()
    early.finish()
    assert early.done() and fut.done() and fut.value() is out
    assert early.future is fut   # one future per operation

    late = _Op("all_reduce", out)
    late.finish()
    late.finish(RuntimeError("a second finish is ignored"))
    assert late.done() and late.future.done() and late.future.value() is out
    late.wait(None)


def test_a_failure_reaches_the_future_and_every_waiter():
    err = GradhubBackendError("gradhub: worker 1 lost")
    op = _Op("all_gather", [torch.zeros(2)])
    seen = []

    def waiter():
        try:
            op.wait(30)
        except GradhubBackendError as e:
            seen.append(e)

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for t in threads:
        t.start()
    op.finish(err)
    for t in threads:
        t.join(10)
    assert seen == [err, err, err]
    # (torch's future raises a callback's error as a RuntimeError naming it)
    with pytest.raises(RuntimeError, match="worker 1 lost"):
        op.future.wait()
    assert not Work(op, 5.0).is_success() and Work(op, 5.0).exception() is err


def test_a_timeout_fails_the_operation_for_good():
    op = _Op("broadcast", [])
    with pytest.raises(GradhubBackendError, match="did not complete within 0.05 s"):
        op.wait(0.05)
    assert op.done()
    op.finish()   # a completion after the timeout changes nothing
    with pytest.raises(GradhubBackendError):
        op.wait(None)
    with pytest.raises(RuntimeError, match="did not complete"):
        op.future.wait()
