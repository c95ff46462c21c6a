"""The fault-injecting TCP proxy (lab/gradhub_lab/proxy.py), on loopback
against a small target server: bytes pass unchanged, and each fault (flip,
reset, down, blackhole), the connection limit and close() do what the fault
campaign relies on. Plain sockets, no gradhub job; a few seconds in all."""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest

from gradhub._ports import free_port
from gradhub_lab.proxy import Proxy


class Target:
    """A server on 127.0.0.1 for the proxy to forward to: records what each
    connection sends (in `received`, one bytearray per connection in the
    order accepted) and, if `echo`, sends it back."""

    def __init__(self, echo: bool = True) -> None:
        self.echo = echo
        self.sock = socket.create_server(("127.0.0.1", free_port()))
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.received: list[bytearray] = []
        self.ended: list[str] = []  # "eof" or "reset", per connection that ended
        self.lock = threading.Lock()
        self.stop = threading.Event()
        threading.Thread(target=self._accept, name="test-target", daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            buf = bytearray()
            with self.lock:
                self.received.append(buf)
            threading.Thread(target=self._serve, args=(c, buf), name="test-target-conn", daemon=True).start()

    def _serve(self, c: socket.socket, buf: bytearray) -> None:
        c.settimeout(10)
        with c:
            while True:
                try:
                    data = c.recv(1 << 16)
                    with self.lock:  # recorded before it is echoed: a test may look once it has the echo
                        buf += data
                    if data and self.echo:
                        c.sendall(data)
                except OSError:
                    self.ended.append("reset")
                    return
                if not data:
                    self.ended.append("eof")
                    return

    def got(self, i: int = 0) -> bytes:
        with self.lock:
            return bytes(self.received[i]) if i < len(self.received) else b""

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.fixture
def rig():
    """make(echo=True, **proxy_options) -> (target, proxy) on 127.0.0.1; all closed afterwards."""
    made: list = []

    def make(echo: bool = True, **kw) -> tuple[Target, Proxy]:
        t = Target(echo)
        p = Proxy("127.0.0.1", free_port(), "127.0.0.1", t.port, **kw)
        made.extend([t, p])
        return t, p

    yield make
    for x in reversed(made):
        x.close()


def connect(p: Proxy, host: str = "127.0.0.1") -> socket.socket:
    s = socket.create_connection((host, p.listen_port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(min(n - len(out), 1 << 20))
        assert chunk, f"EOF after {len(out)} of {n} bytes"
        out += chunk
    return bytes(out)


def wait_for(cond, timeout: float = 3.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def send_in_thread(s: socket.socket, data: bytes, chunks: bool = False) -> threading.Thread:
    """sendall(data) from a thread; `chunks`: in random pieces of 1 to 5,000 bytes."""
    def run() -> None:
        if not chunks:
            s.sendall(data)
            return
        rng, i = random.Random(7), 0
        while i < len(data):
            n = rng.randint(1, 5000)
            s.sendall(data[i:i + n])
            i += n
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def echo_round(s: socket.socket, data: bytes, chunks: bool = False) -> bytes:
    t = send_in_thread(s, data, chunks)
    got = recv_exact(s, len(data))
    t.join(5)
    return got


def test_bytes_pass_unchanged_both_ways():
    """The typical set-up (target on 127.0.0.1:P, proxy on 127.0.0.2:P); one
    connection per size, from 1 byte to 3 MB, echoed back intact."""
    t = Target()
    try:
        with Proxy("127.0.0.2", t.port, "127.0.0.1", t.port) as p:
            sizes = [1, 2, 100, 65535, 65536, 65537, 1_000_000, 3_000_000]
            sent = []
            rng = random.Random(1)
            for size in sizes:
                sent.append(rng.randbytes(size))
                with connect(p, "127.0.0.2") as s:
                    assert echo_round(s, sent[-1]) == sent[-1], size
            total = sum(sizes)
            wait_for(lambda: p.bytes_up == total and p.bytes_down == total, what="counters")
            assert p.accepted == len(sizes) and p.rejected == 0
            assert [t.got(i) for i in range(len(sizes))] == sent
            wait_for(lambda: p.connections == 0, what="pairs to finish")
            assert any("accepted" in e for e in p.events)
    finally:
        t.close()


@pytest.mark.parametrize("direction,after,mask", [
    ("up", 0, 0x01), ("up", 1, 0x80), ("up", 65535, 0x01), ("up", 65536, 0xFF), ("up", 100000, 0x10),
    ("down", 0, 0x01), ("down", 65536, 0x40), ("down", 100000, 0xFF)])
def test_flip_changes_exactly_one_byte(rig, direction, after, mask):
    """Sent in random pieces (so the flipped offset falls anywhere in a
    recv()): exactly byte `after` differs, by `mask`, in the direction asked
    (the target sees it for "up" and not for "down")."""
    t, p = rig()
    data = random.Random(2).randbytes(200_000)
    with connect(p) as s:
        p.flip(direction, after=after, mask=mask)
        got = echo_round(s, data, chunks=True)
    want = bytearray(data)
    want[after] ^= mask
    assert got == bytes(want)
    wait_for(lambda: len(t.got()) == len(data), what="the target's copy")
    assert t.got() == (bytes(want) if direction == "up" else data)
    assert p.flips_done == 1


def test_flip_counts_from_the_next_byte_forwarded(rig):
    """On a connection that has already carried traffic, and on several at once."""
    t, p = rig()
    with connect(p) as s, connect(p) as other:
        first = bytes(1000)
        assert echo_round(s, first) == first
        p.flip("up", after=5)
        assert echo_round(s, bytes(10)) == bytes(5) + b"\x01" + bytes(4)
        p.flip("down", after=3, mask=0x02)  # the first connection to get there takes it, once
        assert echo_round(other, bytes(10)) == bytes(3) + b"\x02" + bytes(6)
        assert echo_round(s, bytes(10)) == bytes(10)
        p.flip("up", after=2)
        p.flip("up", after=7, mask=0x04)  # several pending at once
        assert echo_round(s, bytes(10)) == bytes(2) + b"\x01" + bytes(4) + b"\x04" + bytes(2)
    assert p.flips_done == 4


def test_reset_aborts_both_sides_then_new_connections_work(rig):
    t, p = rig()
    s = connect(p)
    assert echo_round(s, b"hello") == b"hello"
    p.reset()
    with s, pytest.raises(ConnectionResetError):
        s.settimeout(2)
        s.recv(1)
    wait_for(lambda: t.ended == ["reset"], what="the target to see the reset")
    assert p.connections == 0
    with connect(p) as s2:
        assert echo_round(s2, b"again") == b"again"
    assert p.accepted == 2


def test_down_holds_everything_then_up_delivers_it(rig):
    """While down the proxy reads nothing: a 16 MB sendall blocks and the
    target gets nothing (nor a new connection); after up() everything
    arrives, intact and in order."""
    t, p = rig(echo=False)
    s = connect(p)
    s.sendall(b"hello")
    wait_for(lambda: t.got() == b"hello", what="hello")
    p.down()
    data = random.Random(3).randbytes(16 << 20)
    sender = send_in_thread(s, data)
    late = connect(p)  # accepted by the kernel, not dialled until up
    late.sendall(b"late")
    sender.join(0.5)
    assert sender.is_alive(), "sendall finished while the proxy was down"
    assert t.got() == b"hello" and len(t.received) == 1
    p.up()
    sender.join(5)
    assert not sender.is_alive()
    wait_for(lambda: len(t.got()) == 5 + len(data) and t.got(1) == b"late", timeout=5, what="the held bytes")
    assert t.got() == b"hello" + data
    s.close()
    late.close()


def test_down_mid_stream_stops_at_once(rig):
    """Once down() returns not one more byte is forwarded (the target gets
    exactly what had been forwarded by then), and up() resumes in order."""
    t, p = rig(echo=False)
    s = connect(p)
    data = random.Random(4).randbytes(4 << 20)
    sender = send_in_thread(s, data, chunks=True)
    wait_for(lambda: len(t.got()) >= 256 << 10, what="the stream to start")
    p.down()
    forwarded = p.bytes_up
    time.sleep(0.3)
    assert p.bytes_up == forwarded
    wait_for(lambda: len(t.got()) == forwarded, what="what was forwarded before down()")
    p.up()
    sender.join(5)
    wait_for(lambda: len(t.got()) == len(data), timeout=5, what="the rest")
    assert t.got() == data
    s.close()


def test_blackhole_discards_then_up_forwards_new_bytes(rig):
    t, p = rig()
    s = connect(p)
    assert echo_round(s, b"hello") == b"hello"
    p.blackhole()
    lost = b"lost" * 10_000
    s.sendall(lost)
    late = connect(p)  # accepted, its bytes discarded too
    late.sendall(b"late")
    wait_for(lambda: p.bytes_discarded == len(lost) + 4, what="the proxy to discard")
    s.settimeout(0.2)
    with pytest.raises(socket.timeout):
        s.recv(1)
    assert t.got() == b"hello" and len(t.received) == 1
    p.up()
    s.settimeout(5)
    assert echo_round(s, b"found") == b"found"
    assert echo_round(late, b"later") == b"later"
    assert t.got() == b"hello" + b"found" and t.got(1) == b"later"
    s.close()
    late.close()


def test_connection_limit_closes_the_extra_one_at_once(rig):
    t, p = rig(max_pairs=2)
    a, b = connect(p), connect(p)
    assert echo_round(a, b"a") == b"a" and echo_round(b, b"b") == b"b"
    extra = connect(p)
    extra.settimeout(1)
    start = time.monotonic()
    try:
        assert extra.recv(1) == b""
    except ConnectionResetError:
        pass
    assert time.monotonic() - start < 0.5
    wait_for(lambda: p.rejected == 1, what="the count")
    assert p.accepted == 2
    a.close()  # its FIN passes through, the target closes, the pair ends: room again
    wait_for(lambda: p.connections == 1, what="the closed pair to end")
    with connect(p) as c:
        assert echo_round(c, b"c") == b"c"
    b.close()
    extra.close()


def test_target_refusing_closes_the_client():
    port = free_port()  # nobody listens on it
    with Proxy("127.0.0.1", free_port(), "127.0.0.1", port) as p, connect(p) as s:
        s.settimeout(2)
        try:
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass
        assert any("refused" in e for e in p.events), p.events


def test_close_joins_everything(rig):
    t, p = rig()
    s = connect(p)
    assert echo_round(s, b"x") == b"x"
    name = f"gradhub-proxy-{p.listen_port}"
    assert any(th.name == name for th in threading.enumerate())
    p.close()
    # This proxy's thread (another test's proxy may run in this process).
    assert not any(th.name == name for th in threading.enumerate())
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", p.listen_port), timeout=2)
    s.settimeout(2)
    try:
        assert s.recv(1) == b""
    except ConnectionResetError:
        pass
    s.close()
    p.close()  # again: nothing to do
    with Proxy("127.0.0.1", free_port(), "127.0.0.1", t.port) as q:
        with connect(q) as s2:
            assert echo_round(s2, b"y") == b"y"
    # This proxy's thread (another test's proxy may run in this process).
    assert not any(th.name == name for th in threading.enumerate())


def _opening(rank: int, sealed: bool = False) -> bytes:
    """A worker's first frames as the proxy sees them: AuthHello (flagged
    sealed or not), AuthProof, then its DataHello naming `rank` (which an
    encrypted connection follows with a tag)."""
    def frame(msg_type: int, payload: bytes, key: int = 0, flags: int = 0) -> bytes:
        head = bytearray(40)
        head[0:2], head[2], head[3] = (0x4847).to_bytes(2, "little"), 19, msg_type
        head[4:6], head[12:16] = flags.to_bytes(2, "little"), key.to_bytes(4, "little")
        head[28:32] = len(payload).to_bytes(4, "little")
        return bytes(head) + payload
    hello = frame(11, bytes(32) + b"job", flags=64 if sealed else 0)
    return hello + frame(13, bytes(32)) + frame(1, b"", key=rank) + (bytes(16) if sealed else b"")


def test_hold_stops_one_ranks_connections_only(rig):
    """hold(rank) holds the connections whose DataHello names that rank,
    from it on (a new one's too), and nobody else's; release() delivers
    what was held, in order."""
    t, p = rig(echo=False)
    one, two = connect(p), connect(p)
    one.sendall(_opening(1))
    two.sendall(_opening(2, sealed=True))
    wait_for(lambda: len(t.received) == 2 and len(t.got(0)) + len(t.got(1)) >= 2 * 40 * 3,
             what="the openings")
    p.hold(1)
    one.sendall(b"held")
    two.sendall(b"free")
    # Rank 1 again, as a mended link would be: its handshake passes (it
    # comes before the DataHello names the rank), what follows is held.
    later = connect(p)
    opening = _opening(1)
    later.sendall(opening[:-40])
    wait_for(lambda: len(t.received) == 3 and len(t.got(2)) == len(opening) - 40, what="the new handshake")
    later.sendall(opening[-40:] + b"later")
    wait_for(lambda: any(t.got(i).endswith(b"free") for i in range(2)), what="rank 2's bytes")
    time.sleep(0.2)
    assert not any(t.got(i).endswith(b"held") for i in range(3)) and not t.got(2).endswith(b"later")
    p.release(1)
    wait_for(lambda: any(t.got(i).endswith(b"held") for i in range(2)) and t.got(2).endswith(b"later"),
             what="the held bytes")
    for s in (one, two, later):
        s.close()


def test_cut_resets_one_ranks_connections_and_each_new_one(rig):
    """cut(rank): that rank's connections are reset, and a new one is reset
    as soon as its DataHello names the rank; the others pass; restore()
    lets it through again."""
    t, p = rig(echo=True)
    one, two = connect(p), connect(p)
    for s, rank in ((one, 1), (two, 2)):
        s.sendall(_opening(rank))
        assert recv_exact(s, len(_opening(rank))) == _opening(rank)
    p.cut(1)
    with pytest.raises(OSError):
        one.settimeout(3)
        assert one.recv(1) == b""  # an RST: ConnectionResetError, or the end at once
        raise ConnectionResetError
    assert echo_round(two, b"free") == b"free"
    again = connect(p)
    opening = _opening(1)
    again.sendall(opening[:-40])
    assert recv_exact(again, len(opening) - 40) == opening[:-40]  # the handshake passes
    again.sendall(opening[-40:])
    with pytest.raises(OSError):
        again.settimeout(3)
        assert again.recv(1) == b""
        raise ConnectionResetError
    p.restore(1)
    back = connect(p)
    back.sendall(opening)
    assert recv_exact(back, len(opening)) == opening
    for s in (one, two, again, back):
        s.close()


def test_freeze_stops_the_open_connections_for_good_and_lets_new_ones_through(rig):
    """freeze(): what the open connections send afterwards goes nowhere,
    either way, and they stay open; a new connection works."""
    t, p = rig()
    s = connect(p)
    assert echo_round(s, b"hello") == b"hello"
    p.freeze()
    s.sendall(b"lost")
    with connect(p) as s2:
        assert echo_round(s2, b"again") == b"again"
    time.sleep(0.3)
    assert t.got(0) == b"hello" and p.connections == 1  # the frozen one, open
    s.settimeout(0.2)
    with pytest.raises(TimeoutError):
        s.recv(1)
    s.close()
