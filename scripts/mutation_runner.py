"""A warm pytest for mutation runs: third-party imports once, one fork per test run.

cosmic-ray runs its test command once per mutant. A fresh ``python -m pytest`` spends most of
its time importing torch, transformers and the rest (about 10 s on a busy 2-core machine)
before it runs tests that take a second or two. ``serve`` keeps those third-party modules
imported -- never the project's own, which are the ones being mutated -- and forks a child per
run: the child imports the project from the source tree as it is on disk at that moment
(cosmic-ray has written the mutant there), runs pytest with the client's arguments, and the
server hands back its exit status and output. ``run`` is the client, cosmic-ray's test
command; when cosmic-ray's timeout kills it, the server kills that child.

Which modules to keep is learnt: a run asked with ``--learn`` (the driver's baseline run of
each target, on the unmutated tree) reports every module its child imported, and the server
then imports those that are neither under the tree nor one of the project's packages.

Bytecode is never written, so a mutant is always compiled from its source (a cached ``.pyc``
of a same-sized file changed within the same second would be taken for it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import select
import signal
import socket
import sys
import tempfile
import time

#: The exit status of the client when the server cannot be reached: the driver refuses results
#: that carry it (cosmic-ray would count any non-zero status as a killed mutant).
UNREACHABLE = 97
UNREACHABLE_MARK = "mutation runner unreachable"
OUTPUT_TAIL = 20_000


def serve(sock_path: str, root: str, own: list[str]) -> None:
    sys.dont_write_bytecode = True
    # A shell starts a background job with SIGINT ignored, and Python then installs no KeyboardInterrupt
    # handler: the tests of Ctrl-C handling need the handler an interactive `python` would have.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock_path)
    server.listen(1)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            request = b""
            while not request.endswith(b"\n") and (chunk := conn.recv(65536)):
                request += chunk
            if not request.endswith(b"\n"):
                continue  # the client left before asking
            ask = json.loads(request)
            rc, output, imported = _run_forked(conn, root, ask["args"])
            if ask.get("learn"):
                _preload(imported, root, own)
            with contextlib.suppress(OSError):  # the client was killed (a timeout): nobody waits for the answer
                conn.sendall(json.dumps({"rc": rc, "output": output[-OUTPUT_TAIL:]}).encode() + b"\n")


def _preload(names: list[str], root: str, own: list[str]) -> None:
    """Import the third-party modules a run imported; the project's own stay out (they are mutated)."""
    for name in names:
        module = sys.modules.get(name)
        if module is None and name.split(".")[0] not in own:
            try:
                importlib.import_module(name)
            except BaseException:  # one that will not import here is imported by each child instead
                continue
    if leaked := sorted(m for m, mod in sys.modules.items() if _is_own(m, mod, root, own) and m not in ("__main__", "__mp_main__")):
        sys.exit(f"preloading imported the project's own modules ({', '.join(leaked[:5])}): they could not be mutated")


def _is_own(name: str, module: object, root: str, own: list[str]) -> bool:
    if name in ("__main__", "__mp_main__"):
        return True
    path = getattr(module, "__file__", None)
    if not isinstance(path, str) or not os.path.isabs(path):  # built in, or a namespace torch makes up
        return name.split(".")[0] in own
    installed = path.startswith(os.path.abspath(sys.prefix) + os.sep)  # a venv may live inside the tree
    return name.split(".")[0] in own or (path.startswith(root + os.sep) and not installed)


def _run_forked(conn: socket.socket, root: str, pytest_args: list[str]) -> tuple[int, str, list[str]]:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as modules:
        pid = os.fork()
        if pid == 0:  # the child: a fresh pytest over the tree on disk
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
                os.chdir(root)
                import pytest

                rc = int(pytest.main(pytest_args))
                sys.stdout.flush()
                sys.stderr.flush()
                root_dir = os.path.abspath(root)
                names = [m for m, mod in list(sys.modules.items()) if not _is_own(m, mod, root_dir, [])]
                modules.write(json.dumps(names).encode())
                modules.flush()
            except BaseException as exc:  # anything is a failed run, reported as such
                print(f"the test run raised {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                rc = 3
            os._exit(rc)
        status = None
        while status is None:
            done, status_word = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(status_word)
                break
            readable, _, _ = select.select([conn], [], [], 0.05)
            if readable and not conn.recv(1):  # the client is gone: cosmic-ray's timeout
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return 124, "timeout: the client was stopped", []
        out.seek(0)
        text = out.read().decode("utf-8", "replace")
        modules.seek(0)
        imported = json.loads(modules.read() or b"[]")
    return (128 - status if status < 0 else status), text, imported


def run(sock_path: str, wait_s: float, pytest_args: list[str], learn: bool = False) -> int:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.connect(sock_path)
            break
        except OSError as exc:
            client.close()
            if time.monotonic() > deadline:
                print(f"{UNREACHABLE_MARK}: {sock_path}: {exc}", flush=True)
                return UNREACHABLE
            time.sleep(0.2)
    with client:
        client.sendall(json.dumps({"args": pytest_args, "learn": learn}).encode() + b"\n")
        data = b""
        while chunk := client.recv(65536):
            data += chunk
    if not data:
        print(f"{UNREACHABLE_MARK}: the server closed the connection without an answer", flush=True)
        return UNREACHABLE
    answer = json.loads(data)
    sys.stdout.write(answer["output"])
    return int(answer["rc"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="import, listen, fork a pytest per connection")
    s.add_argument("--socket", required=True)
    s.add_argument("--root", required=True, help="the directory pytest runs in")
    s.add_argument("--own", default="", help="comma-separated top-level packages that must not be preloaded")
    r = sub.add_parser("run", help="one test run through the server; its exit status and output")
    r.add_argument("--socket", required=True)
    r.add_argument("--wait-s", type=float, default=30.0, help="how long to wait for the server to listen")
    r.add_argument("--learn", action="store_true", help="then keep the third-party modules this run imported")
    r.add_argument("pytest_args", nargs=argparse.REMAINDER, help="-- then pytest's arguments")
    args = parser.parse_args()
    if args.command == "serve":
        serve(args.socket, os.path.abspath(args.root), [p for p in args.own.split(",") if p])
    else:
        pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
        sys.exit(run(args.socket, args.wait_s, pytest_args, args.learn))


if __name__ == "__main__":
    main()
