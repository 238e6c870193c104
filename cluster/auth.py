"""Who may join the cluster: a shared secret, enforced by ZeroMQ CURVE on every rank socket.

    --cluster-secret S (launcher and ranks) or $PDSERVE_CLUSTER_SECRET (preferred: argv is visible
    to every local user in `ps`)

With a secret, both links that take network input run CURVE (encrypted, authenticated):
  router ROUTER (bind) <- rank DEALER,  decode-rank peer ROUTER (bind) <- prefill-rank DEALER.
  1. Both key pairs are derived from the secret (sha256 of a label + the secret): the server
     pair is what binding sockets hold, the client pair what connecting sockets hold. A peer
     without the secret cannot compute the server's public key, so its handshake fails the
     cryptography (the server sees HANDSHAKE_FAILED_PROTOCOL, the client
     HANDSHAKE_FAILED_NO_DETAIL): no frame of it ever reaches the application.
  2. A ZAP handler on the binding side (`start_authenticator`) also checks that the client's
     long-term key is the derived client key (a leaked server key alone does not let one in).
  3. The rank's link watches its handshake (`handshake_failure`) and exits with the reason.
The launcher generates a secret per start when it starts the ranks and none is given (a local
process cannot join as a rank by default). Without a secret (a router alone, joined by ranks
started by hand) the sockets use ZeroMQ's NULL mechanism; the launcher warns when the rank socket
is bound beyond loopback without one.
Either way every such socket has ZMQ_MAXMSGSIZE (protocol.MAX_FRAME_BYTES): a bigger frame
drops the connection instead of being buffered.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import zmq
import zmq.utils.z85

from cluster import settings
from cluster.protocol import MAX_FRAME_BYTES

log = logging.getLogger(__name__)

SECRET_ENV = settings.CLUSTER_SECRET.name
ZAP_DOMAIN = b"pdserve"
HANDSHAKE_FAILED = frozenset({zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                              zmq.EVENT_HANDSHAKE_FAILED_AUTH})


@dataclass(frozen=True)
class CurveKeys:
    public: bytes  # z85, 40 bytes
    secret: bytes  # z85, 40 bytes


def derive_keys(secret: str, side: str) -> CurveKeys:
    """The CURVE key pair of `side` ("server" binds, "client" connects) for a cluster secret."""
    if not secret:
        raise ValueError("an empty cluster secret derives no keys")
    raw = hashlib.sha256(b"pdserve-curve-" + side.encode() + b"\0" + secret.encode()).digest()
    sk = zmq.utils.z85.encode(raw)
    return CurveKeys(zmq.curve_public(sk), sk)


def bound_frames(sock: zmq.Socket) -> None:
    """A frame bigger than MAX_FRAME_BYTES drops the connection it came on."""
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)


def secure_server(sock: zmq.Socket, secret: str) -> None:
    """Before bind(): CURVE server with the cluster's server keys (no-op without a secret)."""
    bound_frames(sock)
    if secret:
        keys = derive_keys(secret, "server")
        sock.curve_server = True
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.zap_domain = ZAP_DOMAIN


def secure_client(sock: zmq.Socket, secret: str) -> None:
    """Before connect(): CURVE client with the cluster's client keys (no-op without a secret)."""
    bound_frames(sock)
    if secret:
        keys = derive_keys(secret, "client")
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_serverkey = derive_keys(secret, "server").public


class _ClientKeyCheck:
    def __init__(self, secret: str) -> None:
        self.expected = derive_keys(secret, "client").public

    def callback(self, domain: str, client_key: bytes) -> bool:
        ok = client_key == self.expected
        if not ok:
            log.warning("refused a CURVE client with an unknown key (it holds the server key, not the secret)")
        return ok


def start_authenticator(ctx: zmq.Context, secret: str):
    """The ZAP handler of `ctx` (a thread): admits only the cluster's client key. None without
    a secret. The caller stops it (`.stop()`) before terminating the context."""
    if not secret:
        return None
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=logging.getLogger("cluster.auth.zap"))
    auth.start()
    auth.configure_curve_callback(domain=ZAP_DOMAIN.decode(), credentials_provider=_ClientKeyCheck(secret))
    return auth


def handshake_failure(event: int, role: str) -> str | None:
    """The reason to give for a monitor event on a rank socket; None if it is not a refusal."""
    if event not in HANDSHAKE_FAILED:
        return None
    if role == "server":
        return ("a connection failed the handshake: the peer's cluster secret differs, or only one side "
                f"has one (--cluster-secret / ${SECRET_ENV}); nothing it sends is read")
    return (f"the handshake failed: this rank's cluster secret differs from its peer's, or only one side "
            f"has one (--cluster-secret / ${SECRET_ENV})")
