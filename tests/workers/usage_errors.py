"""Worker: user errors get clear exceptions, and the job keeps working."""

import time

import numpy as np

import gradhub
from common import CONFIG

gradhub.init()
r, n = gradhub.rank(), gradhub.size()


def expect(exc, text, fn):
    try:
        fn()
    except exc as e:
        assert text in str(e), f"expected {text!r} in {e!r}"
        return
    raise AssertionError(f"expected {exc.__name__} containing {text!r}")


# Declarations that disagree across workers: both sides get an error.
mine = 100 + (1 if r == 1 else 0)
expect(gradhub.GradhubError, "declared inconsistently", lambda: gradhub.declare([("a", np.zeros(mine, np.float32))]))
# The same through push_pull's implicit declaration.
expect(gradhub.GradhubError, "declared inconsistently",
       lambda: gradhub.push_pull(np.zeros(50 if r == 0 else 60, np.float32), name="b", timeout=30))
# dtype disagreement.
dt = np.float32 if r == 0 else np.float16
expect(gradhub.GradhubError, "declared inconsistently", lambda: gradhub.push_pull(np.zeros(8, dt), name="c", timeout=30))

# Local usage errors.
expect(TypeError, "int16", lambda: gradhub.push_pull(np.zeros(4, np.int16), name="i"))
expect(ValueError, "contiguous", lambda: gradhub.push_pull(np.zeros((4, 4), np.float32)[:, 1], name="nc"))
ro = np.zeros(4, np.float32)
ro.flags.writeable = False
expect(ValueError, "writable", lambda: gradhub.push_pull(ro, name="ro"))
expect(ValueError, "root_rank", lambda: gradhub.broadcast(np.zeros(4, np.float32), root_rank=n))
# dtype= must describe the data: int32 bits summed as float32 would be garbage.
expect(ValueError, "does not match the data's int32",
       lambda: gradhub.push_pull(np.arange(4, dtype=np.int32), name="lie", dtype="float32"))
expect(ValueError, "does not match the data's float32",
       lambda: gradhub.push_pull(np.zeros(4, np.float32), name="lie16", dtype="float16"))
expect(ValueError, "2-byte raw elements",
       lambda: gradhub.push_pull(np.zeros(4, np.uint32), name="liebf", dtype="bfloat16"))
# A broadcast of a bad array is refused before it zeroes anything (non-roots zero their copy).
bad = np.arange(8, dtype=np.complex64)
expect(TypeError, "complex64", lambda: gradhub.broadcast(bad, root_rank=0))
assert np.array_equal(bad, np.arange(8, dtype=np.complex64)), bad
bad32 = np.arange(8, dtype=np.int32)
expect(ValueError, "does not match", lambda: gradhub.broadcast(bad32, root_rank=0, dtype="float32"))
assert np.array_equal(bad32, np.arange(8, dtype=np.int32)), bad32

def while_in_flight(size, message, second):
    """Rank 0 starts a push_pull of `size` elements named "twice" and, while it
    is in flight, expects `second()` to raise ValueError with `message`; the
    other ranks join the round late. The round still sums correctly."""
    z = np.ones(size, np.float32)
    if r == 0:
        h = gradhub.push_pull_async(z, name="twice")
        expect(ValueError, message, second)
        h.wait(30)
    else:
        time.sleep(0.5)
        gradhub.push_pull(z, name="twice", timeout=30)
    assert np.all(z == n)


# Same name twice in flight.
while_in_flight(10, "already being push_pulled",
                lambda: gradhub.push_pull_async(np.ones(10, np.float32), name="twice"))

# A name reused with another size is a new tensor, but not while a round of it is in flight.
w = np.ones(11, np.float32)
gradhub.push_pull(w, name="twice", timeout=30)
assert np.all(w == n)
while_in_flight(11, "cannot change to 12 elements",
                lambda: gradhub.push_pull(np.ones(12, np.float32), name="twice"))

# The job still works.
y = np.full(1000, r + 1.0, np.float32)
gradhub.push_pull(y, name="after", timeout=30)
assert np.all(y == n * (n + 1) / 2)
gradhub.barrier()
print("PASS", r, flush=True)
gradhub.shutdown()
