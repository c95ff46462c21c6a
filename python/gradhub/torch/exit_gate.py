"""One gate between gradhub's own threads and an interpreter that is ending."""

from __future__ import annotations

import atexit
import threading


class _ExitGate:
    """Python's daemon threads die at their next take of the GIL once the
    interpreter finalizes. torch's calls (completing a future, any tensor
    operation) release the GIL and take it back in a C++ destructor, where
    dying is `std::terminate` ("terminate called without an active
    exception"): a clean run's exit status lost. So the backend's own
    threads run torch's code only inside this gate, which atexit closes,
    waiting (up to `wait` s) for those inside. The main thread never waits
    on it (atexit handlers after this one may still complete operations)."""

    def __init__(self, wait: float = 5.0):
        self._cv = threading.Condition()
        self._inside = 0
        self._closed = False
        self._wait = wait

    def enter(self) -> bool:
        """False once closed: the caller leaves torch alone (the process is ending)."""
        if threading.current_thread() is threading.main_thread():
            return True
        with self._cv:
            if self._closed:
                return False
            self._inside += 1
            return True

    def leave(self) -> None:
        if threading.current_thread() is threading.main_thread():
            return
        with self._cv:
            self._inside -= 1
            if self._inside == 0:
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.wait_for(lambda: self._inside == 0, self._wait)


exit_gate = _ExitGate()
atexit.register(exit_gate.close)
