"""A key-value store only the deployment's members can reach: what the rendezvous store runs on with a secret.

torch's TCPStore answers anyone who connects.  :class:`GuardedStoreServer` (node 0) first proves that the
connecting process holds the deployment's secret (an HMAC over a fresh challenge, both ways); a process that
cannot is closed having received nothing but that challenge, and logged.  :class:`GuardedStore` is the client
(and, as ``master``, the host): the calls :class:`~afd_mrv2.mrv2.transport.store.RendezvousStore` makes of a
torch store (``set``, ``get``, ``add``, ``check``, ``wait``, ``delete_key``), with the same meaning.  One
connection per process, one call at a time; a call that fails raises :class:`StoreError` (a RuntimeError, as
torch's store raises) and a connection that broke stays broken.  docs/internals/serve.md, "Only members".
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Any, final

log = logging.getLogger(__name__)

#: What the store says first, before its challenge: a stranger's client learns what it reached.
HELLO = b"afd-mrv2 store 1\n"
#: Bytes of a challenge; of a proof (HMAC-SHA256).
CHALLENGE = 16
PROOF = 32
#: How long a connecting process has to prove it holds the secret.
PROVE_WITHIN_S = 5.0
#: The largest request or answer (a store value is a few hundred bytes: this bounds a member's mistake).
MAX_FRAME = 16 << 20
_LENGTH = struct.Struct("!I")


class StoreError(RuntimeError):
    """A store call that failed: refused, not answered in time, a key never set, or the connection lost."""


def _proof(secret: bytes, who: bytes, *challenges: bytes) -> bytes:
    return hmac.new(secret, who + b"".join(challenges), hashlib.sha256).digest()


def _read(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes; ConnectionError at the end of the stream."""
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise ConnectionError("the connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _read_frame(sock: socket.socket) -> dict[str, Any]:
    (size,) = _LENGTH.unpack(_read(sock, _LENGTH.size))
    if size > MAX_FRAME:
        raise ConnectionError(f"a frame of {size} bytes (at most {MAX_FRAME})")
    message = json.loads(_read(sock, size))
    if not isinstance(message, dict):
        raise ConnectionError("a frame that is no JSON object")
    return message


@final
class GuardedStoreServer:
    """The store's data and its listening socket on ``host:port`` (that address only), served by daemon
    threads: one accepting, one per member connected."""

    def __init__(self, host: str, port: int, secret: bytes) -> None:
        self._secret = secret
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self.where = f"{host}:{port}"
        self._listener = socket.create_server((host, port), backlog=128)
        self._closed = False
        self._members: set[socket.socket] = set()
        threading.Thread(target=self._accept, name="afd-store-accept", daemon=True).start()

    def close(self) -> None:
        """Stop listening and end every member's connection (their calls then fail)."""
        self._closed = True
        self._listener.close()
        with self._changed:
            members, self._members = set(self._members), set()
        for conn in members:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, addr = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn, addr[0]), name="afd-store-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        with conn:
            if not self._admit(conn, peer):
                return
            conn.settimeout(None)
            with self._changed:
                if self._closed:
                    return
                self._members.add(conn)
            try:
                while True:
                    _send_frame(conn, self._answer(_read_frame(conn)))
            except (OSError, ValueError):
                pass  # the member left (or broke the protocol: it is a member, so no alarm)
            with self._changed:
                self._members.discard(conn)

    def _admit(self, conn: socket.socket, peer: str) -> bool:
        """The challenge, the process's proof, the store's own proof; False (logged) for a stranger."""
        challenge = os.urandom(CHALLENGE)
        conn.settimeout(PROVE_WITHIN_S)
        try:
            conn.sendall(HELLO + challenge)
            answer = _read(conn, PROOF + CHALLENGE)
        except OSError as exc:  # ConnectionError (it left) and TimeoutError are OSErrors
            why = "it left without a proof of the deployment's secret"
            if isinstance(exc, TimeoutError):
                why = f"no proof of the deployment's secret within {PROVE_WITHIN_S:g} s"
            log.warning("rendezvous store on %s: refused a connection from %s: %s", self.where, peer, why)
            return False
        proof, theirs = answer[:PROOF], answer[PROOF:]
        if not hmac.compare_digest(proof, _proof(self._secret, b"member", challenge)):
            log.warning(
                "rendezvous store on %s: refused a connection from %s: a wrong proof (not the deployment's secret)",
                self.where,
                peer,
            )
            return False
        conn.sendall(_proof(self._secret, b"store", theirs, challenge))
        return True

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        op, key = request.get("op"), str(request.get("key", ""))
        with self._changed:
            if op == "set":
                self._data[key] = str(request["value"]).encode("latin-1")
                self._changed.notify_all()
                return {"ok": None}
            if op == "add":
                total = int(self._data.get(key, b"0")) + int(request["amount"])
                self._data[key] = str(total).encode()
                self._changed.notify_all()
                return {"ok": total}
            if op == "check":
                return {"ok": all(k in self._data for k in request["keys"])}
            if op == "delete_key":
                return {"ok": self._data.pop(key, None) is not None}
            if op in ("get", "wait"):
                keys = [key] if op == "get" else [str(k) for k in request["keys"]]
                present = self._changed.wait_for(
                    lambda: all(k in self._data for k in keys), float(request["timeout_s"])
                )
                if not present:
                    return {"timeout": ", ".join(k for k in keys if k not in self._data)}
                return {"ok": self._data[key].decode("latin-1") if op == "get" else None}
        return {"error": f"no operation {op!r}"}


@final
class GuardedStore:
    """The deployment's store on ``host:port`` as one process uses it: hosted here (``master``) or reached
    (retrying until ``timeout``, as node 0 may start later); calls wait up to ``timeout`` (a ``get`` for its
    key as well).  :class:`StoreError` when the store refuses this process's ``secret``, or is not the
    deployment's store (it cannot prove the secret)."""

    def __init__(self, host: str, port: int, *, secret: bytes, master: bool, timeout: timedelta) -> None:
        self.where = f"{host}:{port}"
        self.timeout_s = timeout.total_seconds()
        self._secret = secret
        self._lock = threading.Lock()
        self._broken: str | None = None
        try:
            self._server = GuardedStoreServer(host, port, secret) if master else None
        except OSError as exc:
            raise StoreError(f"cannot bind {self.where}: {exc.strerror or exc}") from None
        self._sock = self._connect(host, port)

    def close(self) -> None:
        self._broken = self._broken or "closed"
        self._sock.close()
        if self._server is not None:
            self._server.close()

    def _connect(self, host: str, port: int) -> socket.socket:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise StoreError(f"cannot reach {self.where} within {self.timeout_s:g} s: {exc}") from None
                time.sleep(0.2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.settimeout(PROVE_WITHIN_S * 2)
            hello = _read(sock, len(HELLO) + CHALLENGE)
            if not hello.startswith(HELLO):
                raise StoreError(f"{self.where} is not an afd-mrv2 rendezvous store")
            mine = os.urandom(CHALLENGE)
            sock.sendall(_proof(self._secret, b"member", hello[len(HELLO) :]) + mine)
            proof = _read(sock, PROOF)
        except OSError:
            sock.close()
            raise StoreError(
                f"the rendezvous store on {self.where} refused this process: it does not hold the deployment's secret"
            ) from None
        if not hmac.compare_digest(proof, _proof(self._secret, b"store", mine, hello[len(HELLO) :])):
            sock.close()
            raise StoreError(f"{self.where} cannot prove the deployment's secret: not this deployment's store")
        return sock

    # ------------------------------------------------------------------ torch's store calls, as RendezvousStore makes them

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else value
        self._call({"op": "set", "key": key, "value": data.decode("latin-1")})

    def get(self, key: str) -> bytes:
        return str(self._call({"op": "get", "key": key, "timeout_s": self.timeout_s})).encode("latin-1")

    def add(self, key: str, amount: int) -> int:
        return int(self._call({"op": "add", "key": key, "amount": int(amount)}))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call({"op": "check", "keys": list(keys)}))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = self.timeout_s if timeout is None else timeout.total_seconds()
        self._call({"op": "wait", "keys": list(keys), "timeout_s": seconds})

    def delete_key(self, key: str) -> bool:
        return bool(self._call({"op": "delete_key", "key": key}))

    def _call(self, request: dict[str, Any]) -> Any:
        with self._lock:
            if self._broken is not None:
                raise StoreError(f"the connection to the rendezvous store on {self.where} is gone ({self._broken})")
            self._sock.settimeout(float(request.get("timeout_s", 0.0)) + self.timeout_s)
            try:
                _send_frame(self._sock, request)
                answer = _read_frame(self._sock)
            except (OSError, ValueError) as exc:
                self._broken = "no answer in time" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
                self._sock.close()
                raise StoreError(f"the rendezvous store on {self.where}: {self._broken}") from None
        if "ok" in answer:
            return answer["ok"]
        if "timeout" in answer:
            waited = float(request.get("timeout_s", 0.0))
            raise StoreError(
                f"the rendezvous store on {self.where}: no value for {answer['timeout']} within {waited:g} s"
            )
        raise StoreError(f"the rendezvous store on {self.where}: {answer.get('error')}")
