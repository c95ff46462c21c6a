"""Worker scripts started without importing torch again: a test-harness
speed-up, nothing of gradhub's.

Most of a test job's start-up is each worker importing torch (about 2 s
of CPU a process on this machine). The zygote imports torch, numpy and
gradhub once per test session; a worker command becomes

    python tests/zygote.py SCRIPT ARGS...

a small client that hands the zygote its argv, environment, working
directory and standard streams, and the zygote forks a child that runs
SCRIPT as `__main__` in that state. The client stands in for the child
towards whoever started it (`gradhub launch`, a test's Popen): signals it
gets are forwarded to the child, the child's exit status becomes the
client's (death by a signal included), and a client that dies (SIGKILL
to its process group) takes the child with it (the child watches a pipe
only the client holds).

The client runs the script in a fresh interpreter instead (exec) when no
zygote is named (`GH_ZYGOTE`), when it cannot be reached, or when the
client runs in another network namespace than the zygote (an emulated
host: the child would inherit the zygote's).

The child ends as a process running the script would, up to the
interpreter's finalization: an uncaught exception is reported by
sys.excepthook, non-daemon threads are joined, atexit handlers run and the
standard streams are flushed, and the exit status is the script's (an
uncaught KeyboardInterrupt ends it by SIGINT, as Python does). Then it
leaves with os._exit: tearing down the zygote's inherited heap would copy
every page of it (copy-on-write), about a second of CPU per worker. A test
of interpreter finalization itself runs its worker fresh (conftest's
`worker_argv(fresh=True)`).
"""

import json
import os
import signal
import socket
import struct
import sys

# Signals the client forwards to the child (SIGKILL and SIGSTOP cannot be caught).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _netns() -> str:
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


# ---------------------------------------------------------------- client


def _exec(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *argv])


def client(argv: list[str]) -> None:
    spec = os.environ.get("GH_ZYGOTE", "")
    path, _, netns = spec.partition("|")
    if not path or netns != _netns():
        _exec(argv)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except OSError:
        s.close()
        _exec(argv)
    alive_r, alive_w = os.pipe()  # the child's end sees EOF when this process dies
    env = {k: v for k, v in os.environ.items() if k != "GH_ZYGOTE"}
    head = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode()
    s.sendmsg([struct.pack("!I", len(head)) + head],
              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("4i", 0, 1, 2, alive_r))])
    os.close(alive_r)

    def forward(signum, _frame):
        try:
            s.sendall(f"sig {signum}\n".encode())
        except OSError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    buf = b""
    while b"exit " not in buf or not buf.endswith(b"\n"):
        try:
            data = s.recv(256)
        except InterruptedError:
            continue
        if not data:
            print("tests/zygote.py: the zygote went away before the worker ended", file=sys.stderr)
            os._exit(70)
        buf += data
    status = int(buf.split(b"exit ", 1)[1].split()[0])
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if not os.WIFSIGNALED(status) else 128 + os.WTERMSIG(status))


# ---------------------------------------------------------------- zygote


def _recv_request(conn: socket.socket):
    """(request, fds) of a new client, or None if it went away."""
    fds: list[int] = []
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        msg, anc, _flags, _addr = conn.recvmsg(1 << 20, socket.CMSG_SPACE(4 * 4))
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += list(struct.unpack(f"{len(raw) // 4}i", raw[:len(raw) - len(raw) % 4]))
        if not msg:
            for fd in fds:
                os.close(fd)
            return None
        data += msg
    return json.loads(data[4:]), fds


def _become(req: dict, fds: list[int]) -> None:
    """In the forked child: take the client's state and run its script."""
    import random
    import runpy
    import threading

    for sig in FORWARDED + (signal.SIGCHLD,):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python sets them up
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    stdin, stdout, stderr, alive = fds
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.set_inheritable(alive, False)

    def watch():
        while os.read(alive, 1):
            pass
        os.kill(os.getpid(), signal.SIGKILL)  # the client is gone: so is its worker

    threading.Thread(target=watch, daemon=True, name="zygote-client-watch").start()
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdout.reconfigure(line_buffering=True, write_through=unbuffered)
    sys.stderr.reconfigure(line_buffering=True, write_through=True)
    # Fresh processes draw fresh random states; forked ones would share the zygote's.
    random.seed()
    try:
        import numpy as np

        np.random.seed(int.from_bytes(os.urandom(4), "little"))
    except ImportError:
        pass
    script, args = req["argv"][0], req["argv"][1:]
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = _exit_status(e.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _leave(code)


def _exit_status(code) -> int:
    """The status `sys.exit(code)` gives, as the interpreter words it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _leave(code: int) -> None:
    """What Python's finalization does that a script can see, then exit
    without tearing the heap down (see the module's docstring)."""
    import atexit
    import threading

    try:
        threading._shutdown()  # joins non-daemon threads, as finalization does first
    except BaseException:
        sys.excepthook(*sys.exc_info())
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:  # an uncaught KeyboardInterrupt: die by SIGINT, as Python does
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def serve(path: str) -> None:
    """Preload, then fork a child per client until stdin closes (the test
    session ended). Single-threaded, so forking is safe."""
    import selectors

    import numpy  # noqa: F401
    import torch  # noqa: F401

    import torch.distributed  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    import gradhub  # noqa: F401
    import gradhub.torch  # noqa: F401

    # Its first call imports about 900 modules (a second of CPU).
    torch.use_deterministic_algorithms(True)
    torch.use_deterministic_algorithms(False)

    import threading

    # No Python thread may hold a lock across the fork (OpenBLAS's native
    # pool re-forms itself in the child: it registers fork handlers).
    assert threading.active_count() == 1, f"the zygote forks: it must have no other thread ({threading.enumerate()})"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    children: dict[int, socket.socket] = {}  # pid -> its client's connection
    by_conn: dict[socket.socket, int] = {}
    print("ready", flush=True)
    while True:
        for key, _ in sel.select(timeout=0.02):
            if key.data == "stdin":
                if not sys.stdin.readline():
                    os._exit(0)  # the session ended; children stay with their clients
            elif key.data == "accept":
                conn, _ = listener.accept()
                got = _recv_request(conn)
                if got is None:
                    conn.close()
                    continue
                req, fds = got
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    listener.close()
                    for c in by_conn:
                        c.close()
                    conn.close()
                    _become(req, fds)  # never returns
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"pid {pid}\n".encode())
                children[pid] = conn
                by_conn[conn] = pid
                sel.register(conn, selectors.EVENT_READ, "client")
            else:
                conn = key.fileobj
                try:
                    data = conn.recv(256)
                except OSError:
                    data = b""
                pid = by_conn.get(conn)
                if not data:  # the client died; its child follows through its pipe
                    sel.unregister(conn)
                    continue
                for line in data.decode().splitlines():
                    if line.startswith("sig ") and pid is not None:
                        try:
                            os.kill(pid, int(line[4:]))
                        except ProcessLookupError:
                            pass
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                by_conn.pop(conn, None)
                try:
                    conn.sendall(f"exit {status}\n".encode())
                except OSError:
                    pass
                try:
                    sel.unregister(conn)
                except (KeyError, ValueError):
                    pass
                conn.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        client(sys.argv[1:])
