"""A stranger on another host of a running multi-host job (run in a network
namespace of its own by test_auth): without the job's token it tries to
register as a worker, as a server, and to claim worker 0's connection on
each server port. Prints REFUSED <what> for every attempt that was refused.
Usage: rogue.py register SCHEDULER      (before the workers have registered)
       rogue.py squat HOST PORT [...]   (while the job runs)"""

import socket
import struct
import sys
import time

from gradhub import _core

phase = sys.argv[1]


def register(sched):
    for token, what in (("not-the-job-token", "worker with a wrong token"), (None, "worker without a token")):
        try:
            _core.Client(_core.ClientConfig(sched, rank=0, num_workers=2, connect_timeout=5.0, token=token))
            print(f"ACCEPTED {what}", flush=True)
        except _core.GradhubError as e:
            assert "authentication failed" in str(e), e
            print(f"REFUSED {what}", flush=True)

    try:
        _core.run_server(_core.ServerConfig(sched, threads=1, advertise=None, bind_host="0.0.0.0",
                                            connect_timeout=5.0, token="not-the-job-token"))
        print("ACCEPTED server", flush=True)
    except _core.GradhubError as e:
        assert "authentication failed" in str(e), e
        print("REFUSED server", flush=True)


# A DataHello (type 1) claiming worker 0 (key 0), with no handshake.
hello = _core.encode_frame(1, key=0)


def connect(port):
    """The server may still be starting: retry for a while."""
    host = sys.argv[2]
    deadline = time.monotonic() + 30
    while True:
        try:
            return socket.create_connection((host, port), timeout=10)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def squat(port):
    """The server's threads serve the port once the job has started: until
    then a connection waits unanswered, so try again."""
    deadline = time.monotonic() + 60
    while True:
        s = connect(port)
        s.settimeout(2)
        s.sendall(hello)
        reply = b""
        try:
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                reply += chunk
        except TimeoutError:
            assert time.monotonic() < deadline, "no answer from the server"
            s.close()
            continue
        s.close()
        assert reply[3] == 5 and b"authentication failed" in reply, reply  # an Error frame, then closed
        assert struct.unpack("<I", reply[8:12])[0] == 0, "the rejection reveals no namespace"
        print(f"REFUSED rank 0 on port {port}", flush=True)
        return


if phase == "register":
    register(sys.argv[2])
else:
    host = sys.argv[2]
    for p in sys.argv[3:]:
        squat(int(p))
