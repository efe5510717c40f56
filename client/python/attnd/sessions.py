"""Sessions over several attnd replicas, placed and routed as the C++ client does
(client/include/attn/client/session.h):

- a new session goes to the replica with the most free KV pages now (asked at that moment), ties
  to the one with fewer sessions, then in turn; a replica that answers RESOURCE_EXHAUSTED,
  UNAVAILABLE or DEADLINE_EXCEEDED is passed over for the next;
- every call on a session goes to the replica that holds it, found from the id's prefix
  ``<replica_id>.`` (the longest matching id), so ids made by another process route too; an id
  of a replica not known makes the client resolve its targets again (at most once a second).

Targets: ``host:port`` / ``dns:///host:port`` (every address the name resolves to now: a
Kubernetes headless Service), ``ipv4:a:p,b:p`` / ``ipv6:[a]:p,...`` (each address), ``unix:/path``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Dict, List, NoReturn, Optional, Sequence, Tuple, Union

import grpc

from . import _core
from .client import Client, Session
from .errors import (AttndError, BatchStepError, FailedPrecondition, InvalidArgument, NotFound,
                     Unavailable)

_PASS_OVER = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE,
              grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass
class ReplicaInfo:
    """A replica as last seen: its id, address, and what its GetServerInfo said."""

    replica_id: str
    endpoint: str
    free_pages: int = 0
    total_pages: int = 0
    sessions: int = 0


@dataclass
class Endpoint:
    address: str  # a channel target: "ipv4:10.0.0.5:50051", "ipv6:[fd00::5]:50051", "unix:/p"
    host: str     # the name it was resolved from ("" for a literal address)


def _split_host_port(target: str, hostport: str) -> Tuple[str, str]:
    if hostport.startswith("["):
        close = hostport.find("]")
        if close < 0:
            raise InvalidArgument(f"target {target!r}: unclosed '['")
        host, rest = hostport[1:close], hostport[close + 1:]
        port = rest[1:] if rest.startswith(":") else ""
    elif ":" in hostport:
        host, _, port = hostport.rpartition(":")
    else:
        host, port = hostport, ""
    if not port:
        raise InvalidArgument(f"target {target!r} has no port (expected host:port, e.g. "
                              "attnd-headless.attnd.svc.cluster.local:50051)")
    if not host:
        raise InvalidArgument(f"target {target!r} has no host")
    return host, port


def resolve_target(target: str) -> List[Endpoint]:
    """The addresses a gRPC target stands for, one channel target each."""
    if not target:
        raise InvalidArgument("empty target")
    for scheme in ("unix:", "unix-abstract:", "vsock:", "xds:", "google-c2p:"):
        if target.startswith(scheme):
            return [Endpoint(target, "")]
    for scheme in ("ipv4:", "ipv6:"):
        if target.startswith(scheme):
            out = []
            for a in target[len(scheme):].split(","):
                _split_host_port(target, a)
                out.append(Endpoint(scheme + a, ""))
            return out
    hostport = target
    if hostport.startswith("dns:"):
        hostport = hostport[4:]
        if hostport.startswith("//"):
            slash = hostport.find("/", 2)
            if slash < 0:
                raise InvalidArgument(f"target {target!r}: expected dns:///host:port")
            hostport = hostport[slash + 1:]
    host, port = _split_host_port(target, hostport)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise Unavailable(f"target {target!r}: cannot resolve {host!r}: {e}") from e
    try:
        ipaddress.ip_address(host)
        literal = True
    except ValueError:
        literal = False
    out: List[Endpoint] = []
    for family, _, _, _, sockaddr in infos:
        if family == socket.AF_INET:
            address = f"ipv4:{sockaddr[0]}:{port}"
        elif family == socket.AF_INET6:
            address = f"ipv6:[{sockaddr[0]}]:{port}"
        else:
            continue
        if all(e.address != address for e in out):
            out.append(Endpoint(address, "" if literal else host))
    if not out:
        raise Unavailable(f"target {target!r}: {host!r} has no address")
    return out


# A session that moved (hand-off on drain, attention.proto ImportSession): FAILED_PRECONDITION whose
# message holds "attnd-moved-to: <address>;<new id>" (an empty address: the replica that answered,
# which took the session and was asked by its old id); one being moved: UNAVAILABLE with
# "attnd-session-moving" (nothing applied; sent again shortly).
_MOVED_TO = "attnd-moved-to: "
_MOVING = "attnd-session-moving"
_MOVING_PAUSE_MAX = 0.05


def _moved_to(e: Any) -> Optional[Tuple[str, str]]:
    if not isinstance(e, FailedPrecondition):
        return None
    at = e.message.rfind(_MOVED_TO)
    if at < 0:
        return None
    address, semi, new_id = e.message[at + len(_MOVED_TO):].split(")")[0].partition(";")
    return (address, new_id) if semi and "." in new_id else None


def _moving(e: Any) -> bool:
    return isinstance(e, Unavailable) and _MOVING in e.message


def _unreached(e: Any) -> bool:
    """The replica could not be reached (or refused for a reason of its own, not the move)."""
    return isinstance(e, Unavailable) and not _moving(e)


class _Replica:
    def __init__(self, info: ReplicaInfo, client: Any):
        self.info = info
        self.client = client


class _Routing:
    """Replicas by id and the choice of where a session goes (no I/O)."""

    def __init__(self, targets: Union[str, Sequence[str]], info_timeout: float,
                 refresh_interval: float, min_refresh_interval: float, client_options: Dict[str, Any]):
        self.targets = [targets] if isinstance(targets, str) else list(targets)
        if not self.targets:
            raise InvalidArgument("SessionClient: no target")
        self.info_timeout = info_timeout
        self.refresh_interval = refresh_interval
        self.min_refresh_interval = min_refresh_interval
        self.client_options = dict(client_options)
        self.replicas: List[_Replica] = []
        self.refreshed_at = float("-inf")
        self.create_turn = 0
        self.moved: Dict[str, str] = {}  # old session id -> the id it moved to
        # Replicas learned from moves that the targets did not name (kept across refreshes).
        self.followed: List[_Replica] = []
        self.lock = threading.Lock()

    def learn_move(self, session_id: str, e: Any, make_client: Any) -> bool:
        """True when e says session_id moved: the new id and its replica (a client of its
        address made with make_client(Endpoint) if it is not known) are then known."""
        to = _moved_to(e)
        if to is None or to[1] == session_id:
            return False
        address, new_id = to
        if self.find(new_id) is None:
            if not address:  # the replica that answered, which is known
                return False
            try:
                endpoint = resolve_target(address)[0]
            except (AttndError, IndexError):
                return False
            replica = _Replica(ReplicaInfo(new_id.rsplit(".", 1)[0], endpoint.address, 0, 0, 0),
                               make_client(endpoint))
            with self.lock:
                self.followed.append(replica)
        with self.lock:
            self.moved[session_id] = new_id
        return True

    def current(self, session_id: str) -> str:
        """The id session_id goes by now (it may have moved more than once)."""
        with self.lock:
            for _ in range(16):
                if session_id not in self.moved:
                    break
                session_id = self.moved[session_id]
        return session_id

    def resolve(self) -> Tuple[List[Endpoint], List[str]]:
        endpoints: List[Endpoint] = []
        problems: List[str] = []
        for t in self.targets:
            try:
                for e in resolve_target(t):
                    if all(x.address != e.address for x in endpoints):
                        endpoints.append(e)
            except AttndError as e:
                problems.append(e.message)
        return endpoints, problems

    def options_for(self, e: Endpoint) -> Dict[str, Any]:
        o = dict(self.client_options)
        tls = o.get("tls") or o.get("tls_ca") is not None or o.get("tls_cert") is not None
        # The certificate names the service, not each pod's address.
        if tls and not o.get("tls_server_name") and e.host:
            o["tls_server_name"] = e.host
        return o

    def known_by_address(self) -> Dict[str, _Replica]:
        with self.lock:
            return {r.info.endpoint: r for r in self.replicas}

    def install(self, endpoints: List[Endpoint], clients: List[Any], answers: List[Any],
                problems: List[str]) -> None:
        known = self.known_by_address()
        fresh: List[_Replica] = []
        for e, c, a in zip(endpoints, clients, answers):
            if isinstance(a, Exception):
                problems.append(f"{e.address}: {a}")
                continue
            if a.replica_id and any(r.info.replica_id == a.replica_id for r in fresh):
                continue  # two addresses of one process (127.0.0.1 and ::1)
            rid = a.replica_id or (known[e.address].info.replica_id if e.address in known else "")
            fresh.append(_Replica(ReplicaInfo(rid, e.address, a.kv_cache.free_pages,
                                              a.kv_cache.total_pages, a.kv_cache.sessions), c))
        with self.lock:
            self.refreshed_at = time.monotonic()
            if not fresh:  # keep what was known: a resolver hiccup must not strand sessions
                raise Unavailable(
                    f"no attnd answered GetServerInfo at {', '.join(self.targets)}: " +
                    ("; ".join(problems) if problems else "the targets resolved to no address"))
            self.replicas = fresh

    def others(self, unreached: Optional[_Replica]) -> List[_Replica]:
        """The known replicas but `unreached` (its client's)."""
        with self.lock:
            return [r for r in self.replicas + self.followed
                    if unreached is None or (r is not unreached and r.client is not unreached.client)]

    def find(self, session_id: str) -> Optional[_Replica]:
        best = None
        with self.lock:
            for r in self.replicas + self.followed:
                rid = r.info.replica_id
                if rid and session_id.startswith(rid + ".") and len(session_id) > len(rid) + 1:
                    if best is None or len(rid) > len(best.info.replica_id):
                        best = r
        return best

    def no_replica(self, session_id: str) -> NotFound:
        with self.lock:
            known = [f"{r.info.replica_id or '(id not known)'} at {r.info.endpoint}"
                     for r in self.replicas]
        dot = session_id.rfind(".")
        if dot <= 0:
            return NotFound(f"session {session_id!r}: not a session id (expected "
                            "<replica_id>.<random>)")
        return NotFound(f"session {session_id!r} is held by replica {session_id[:dot]!r}, which is "
                        f"none of the replicas this client reaches ({', '.join(known)}): that "
                        "replica has gone, and its sessions with it, or is not among the targets")

    def due(self, age: float) -> bool:
        with self.lock:
            return time.monotonic() - self.refreshed_at >= age

    def rank(self, replicas: List[_Replica], answers: List[Any]) -> List[Tuple[_Replica, str]]:
        """The replicas in the order a create tries them: those that answer, most free pages first,
        then fewest sessions, then in turn."""
        with self.lock:
            turn = self.create_turn
            self.create_turn += 1
        n = len(replicas)
        rows = []
        for i, (r, a) in enumerate(zip(replicas, answers)):
            answered = not isinstance(a, Exception)
            if answered:
                r.info.free_pages = a.kv_cache.free_pages
                r.info.total_pages = a.kv_cache.total_pages
                r.info.sessions = a.kv_cache.sessions
            rows.append(((not answered, -r.info.free_pages if answered else 0,
                          r.info.sessions if answered else 0, (i + n - turn % n) % n), r))
        rows.sort(key=lambda x: x[0])
        return [(r, f"{r.info.replica_id} at {r.info.endpoint}") for _, r in rows]


def _current_item(routing: _Routing, raw: Any) -> Any:
    """The step item with the id its session goes by now."""
    item = _core.as_step_item(raw)
    sid = _core.session_id_of(item.session)
    now = routing.current(sid)
    return raw if now == sid else replace(item, session=now)


def _group(items: Sequence[Any], route: Any) -> Tuple[List[Any], List[Tuple[Any, List[int]]]]:
    results: List[Any] = [None] * len(items)
    groups: List[Tuple[Any, List[int]]] = []
    for i, raw in enumerate(items):
        item = _core.as_step_item(raw)
        try:
            replica = route(_core.session_id_of(item.session))
        except AttndError as e:
            results[i] = e
            continue
        for g in groups:
            if g[0] is replica:
                g[1].append(i)
                break
        else:
            groups.append((replica, [i]))
    return results, groups


class _Placement:
    """A CreateSession's tries over ranked replicas: a replica that refuses for want of room or
    reach is passed over (any other error is raised at once); the replica that creates the
    session has its id learnt; when every replica refused, the error names each refusal."""

    def __init__(self, routing: "_Routing"):
        self._routing = routing
        self._last: AttndError = Unavailable("CreateSession: no replica is known")
        self._tried: List[str] = []

    def failed(self, name: str, e: AttndError) -> None:
        self._last = e
        self._tried.append(f"{name}: {e.code.name}: {e.message}")
        if e.code not in _PASS_OVER:
            raise e

    def placed(self, replica: "_Replica", session: Any) -> None:
        if session.info.replica_id:
            with self._routing.lock:
                replica.info.replica_id = session.info.replica_id

    def raise_exhausted(self) -> NoReturn:
        if len(self._tried) <= 1:
            raise self._last
        raise type(self._last)(
            f"CreateSession failed on every replica: {'; '.join(self._tried)}", self._last.code)


class _FollowingClient:
    """What the Session objects of a SessionClient call: every call goes to the replica that
    holds the session now, following it when it moves (SessionClient._on_session)."""

    def __init__(self, sessions: "SessionClient", session_id: str):
        self._sessions = sessions
        self._session_id = session_id

    @property
    def options(self) -> Any:
        return self._sessions.client_for(self._session_id).options

    def step(self, session: Any, layer: int, q: Any, k_new: Any, v_new: Any,
             **options: Any) -> _core.StepResult:
        return self._sessions.step(_core.session_id_of(session), layer, q, k_new, v_new, **options)

    def truncate_session(self, session_id: str, tokens: int, timeout: Optional[float] = None) -> Any:
        return self._sessions.truncate_session(session_id, tokens, timeout)

    def fork_session(self, session_id: str, timeout: Optional[float] = None) -> Any:
        return self._sessions._on_session(session_id, timeout,
                                          lambda sid, c: c.fork_session(sid, timeout))

    def close_session(self, session_id: str, timeout: Optional[float] = None) -> int:
        return self._sessions.close_session(session_id, timeout)


class SessionClient:
    """Sessions over one or many attnd replicas (see the module's description).

    Args:
        targets: a target or a list of them.
        info_timeout: deadline of the GetServerInfo calls that find replicas and their free pages.
        refresh_interval: resolve the targets again before a create when older than this (s).
        min_refresh_interval: at most this often when an id names an unknown replica (s).
        client_options: attnd.Client's keyword arguments for every replica (TLS, token, ...).
    """

    def __init__(self, targets: Union[str, Sequence[str]], *, info_timeout: float = 3.0,
                 refresh_interval: float = 30.0, min_refresh_interval: float = 1.0,
                 **client_options: Any):
        self._routing = _Routing(targets, info_timeout, refresh_interval, min_refresh_interval,
                                 client_options)
        self._refresh_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="attnd-replicas")
        self.refresh()

    def _ask_all(self, clients: List[Client]) -> List[Any]:
        def ask(c: Client) -> Any:
            try:
                return c.info(timeout=self._routing.info_timeout)
            except AttndError as e:
                return e
        return list(self._pool.map(ask, clients))

    def refresh(self) -> None:
        """Resolves the targets again and asks each address for its replica id (the clients of
        addresses already known are kept, with their connections)."""
        with self._refresh_lock:
            endpoints, problems = self._routing.resolve()
            known = self._routing.known_by_address()
            clients = [known[e.address].client if e.address in known else
                       Client(e.address, **self._routing.options_for(e)) for e in endpoints]
            self._routing.install(endpoints, clients, self._ask_all(clients), problems)

    def _refresh_if_older(self, age: float) -> None:
        if self._routing.due(age):
            try:
                self.refresh()
            except AttndError:
                pass  # the known replicas stay; the call reports its own error

    def _route(self, session_id: str) -> _Replica:
        session_id = self._routing.current(session_id)
        r = self._routing.find(session_id)
        if r is None:
            self._refresh_if_older(self._routing.min_refresh_interval)
            r = self._routing.find(session_id)
        if r is None:
            raise self._routing.no_replica(session_id)
        return r

    def current_session_id(self, session_id: str) -> str:
        """The id a session goes by now: itself, or the id it got where it moved to."""
        return self._routing.current(session_id)

    def _learn_move(self, session_id: str, e: AttndError) -> bool:
        return self._routing.learn_move(
            session_id, e, lambda ep: Client(ep.address, **self._routing.options_for(ep)))

    def _find_moved(self, session_id: str, unreached: Optional[_Replica], deadline: float) -> bool:
        """The session's replica is gone or not reached: asks the other replicas (the targets
        resolved again) whether one took it in a hand-off, and learns the move from it. A
        truncate of no token changes nothing: the replica that took the session answers its old
        id with the new one, the others that they do not hold it."""
        self._refresh_if_older(self._routing.min_refresh_interval)
        for r in self._routing.others(unreached):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                r.client.truncate_session(session_id, 0, min(left, self._routing.info_timeout))
            except AttndError as e:
                if self._learn_move(session_id, e):
                    return True
        return False

    def _on_session(self, session_id: str, timeout: Optional[float], call: Any) -> Any:
        """call(current id, client) on the session's replica, following a move (twice at most;
        also one found by asking the other replicas when its replica cannot be reached) and
        sending again a call refused while the session moves, within timeout."""
        deadline = time.monotonic() + (timeout if timeout is not None else 60.0)
        sid = self._routing.current(session_id)
        follows, pause = 0, 0.002
        while True:
            replica = None
            try:
                replica = self._route(sid)
                return call(sid, replica.client)
            except AttndError as e:
                if follows < 2 and self._learn_move(sid, e):
                    sid, follows = self._routing.current(sid), follows + 1
                    continue
                if _moving(e) and time.monotonic() + pause < deadline:
                    time.sleep(pause)
                    pause = min(pause * 2, _MOVING_PAUSE_MAX)
                    continue
                if (follows < 2 and (replica is None or _unreached(e))
                        and self._find_moved(sid, replica, deadline)):
                    sid, follows = self._routing.current(sid), follows + 1
                    continue
                raise

    def replicas(self) -> List[ReplicaInfo]:
        with self._routing.lock:
            return [ReplicaInfo(**r.info.__dict__) for r in self._routing.replicas]

    def client_for(self, session_id: str) -> Client:
        """The Client of the replica that holds session_id."""
        return self._route(session_id).client

    def create_session(self, num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype: Any = "bfloat16", max_tokens: int = 0,
                       timeout: Optional[float] = None, *, cache_dtype: Any = None,
                       k_scales: Any = None, v_scales: Any = None) -> Session:
        """A new session on the replica with the most free KV pages now."""
        self._refresh_if_older(self._routing.refresh_interval)
        with self._routing.lock:
            replicas = list(self._routing.replicas)
        ranked = self._routing.rank(replicas, self._ask_all([r.client for r in replicas]))
        attempts = _Placement(self._routing)
        for r, name in ranked:
            try:
                s = r.client.create_session(num_layers, num_kv_heads, head_dim, dtype, max_tokens,
                                            timeout, cache_dtype=cache_dtype,
                                            k_scales=k_scales, v_scales=v_scales)
            except AttndError as e:
                attempts.failed(name, e)
                continue
            attempts.placed(r, s)
            s.client = _FollowingClient(self, s.id)
            return s
        attempts.raise_exhausted()

    def session(self, session_id: str) -> Session:
        """A Session object for an id; its calls go to the replica that holds it, following it
        when it moves."""
        s = self._route(session_id).client.session(session_id)
        s.client = _FollowingClient(self, session_id)
        return s

    def step(self, session: Any, layer: int, q: Any, k_new: Any, v_new: Any,
             **options: Any) -> _core.StepResult:
        return self._on_session(
            _core.session_id_of(session), options.get("timeout"),
            lambda sid, c: c.step(sid, layer, q, k_new, v_new, **options))

    def batch_step(self, items: Sequence[Any], *, timeout: Optional[float] = None,
                   return_exceptions: bool = False) -> List[Any]:
        """Items of several replicas go as one BatchStep per replica, in parallel; results come
        back in the order of items (failed items as in Client.batch_step)."""
        results, groups = _group(items, self._route)
        unrouted = {i for i, r in enumerate(results) if r is not None}  # no replica known
        # Items of moved sessions go with the ids they have now.
        sent = [_current_item(self._routing, x) for x in items]

        def send(group: Tuple[_Replica, List[int]]) -> Any:
            try:
                return group[0].client.batch_step([sent[i] for i in group[1]], timeout=timeout,
                                                  return_exceptions=True)
            except AttndError as e:
                return e
        for (replica, idx), answer in zip(groups, self._pool.map(send, groups)):
            for j, i in enumerate(idx):
                results[i] = answer if isinstance(answer, AttndError) else answer[j]
        # Items whose session moved, or was moving, go again one by one (following it), in order;
        # so do those whose replica is gone or not reached (another may have taken the session).
        for i, r in enumerate(results):
            if _moved_to(r) is not None or _moving(r) or _unreached(r) or i in unrouted:
                item = _core.as_step_item(items[i])
                try:
                    results[i] = self._on_session(
                        _core.session_id_of(item.session), timeout,
                        lambda sid, c: c.batch_step([replace(item, session=sid)], timeout=timeout)[0])
                except BatchStepError as e:
                    results[i] = e.results[0]
                except AttndError as e:
                    results[i] = e
        if not return_exceptions and any(isinstance(r, AttndError) for r in results):
            raise BatchStepError(results)
        return results

    def truncate_session(self, session_id: str, tokens: int,
                         timeout: Optional[float] = None) -> _core.TruncateResult:
        return self._on_session(session_id, timeout,
                                lambda sid, c: c.truncate_session(sid, tokens, timeout))

    def fork_session(self, session_id: str, timeout: Optional[float] = None) -> Session:
        return self.session(session_id).fork(timeout)

    def close_session(self, session_id: str, timeout: Optional[float] = None) -> int:
        return self._on_session(session_id, timeout,
                                lambda sid, c: c.close_session(sid, timeout))

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for r in self._routing.replicas + self._routing.followed:
            r.client.close()

    def __enter__(self) -> "SessionClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncSessionClient:
    """asyncio twin of SessionClient (make it with ``await AsyncSessionClient.create(...)``)."""

    def __init__(self, targets: Union[str, Sequence[str]], *, info_timeout: float = 3.0,
                 refresh_interval: float = 30.0, min_refresh_interval: float = 1.0,
                 **client_options: Any):
        self._routing = _Routing(targets, info_timeout, refresh_interval, min_refresh_interval,
                                 client_options)
        self._refresh_lock = asyncio.Lock()

    @classmethod
    async def create(cls, targets: Union[str, Sequence[str]], **kwargs: Any) -> "AsyncSessionClient":
        c = cls(targets, **kwargs)
        await c.refresh()
        return c

    async def _ask_all(self, clients: List[Any]) -> List[Any]:
        async def ask(c: Any) -> Any:
            try:
                return await c.info(timeout=self._routing.info_timeout)
            except AttndError as e:
                return e
        return list(await asyncio.gather(*(ask(c) for c in clients)))

    async def refresh(self) -> None:
        from . import aio

        async with self._refresh_lock:
            endpoints, problems = self._routing.resolve()
            known = self._routing.known_by_address()
            clients = [known[e.address].client if e.address in known else
                       aio.Client(e.address, **self._routing.options_for(e)) for e in endpoints]
            self._routing.install(endpoints, clients, await self._ask_all(clients), problems)

    async def _route(self, session_id: str) -> _Replica:
        session_id = self._routing.current(session_id)
        r = self._routing.find(session_id)
        if r is None and self._routing.due(self._routing.min_refresh_interval):
            try:
                await self.refresh()
            except AttndError:
                pass
            r = self._routing.find(session_id)
        if r is None:
            raise self._routing.no_replica(session_id)
        return r

    def replicas(self) -> List[ReplicaInfo]:
        with self._routing.lock:
            return [ReplicaInfo(**r.info.__dict__) for r in self._routing.replicas]

    def current_session_id(self, session_id: str) -> str:
        """The id a session goes by now: itself, or the id it got where it moved to."""
        return self._routing.current(session_id)

    async def _on_session(self, session_id: str, timeout: Optional[float], call: Any) -> Any:
        """As SessionClient._on_session: await call(current id, client), following a move."""
        deadline = time.monotonic() + (timeout if timeout is not None else 60.0)
        sid = self._routing.current(session_id)
        follows, pause = 0, 0.002
        while True:
            replica = None
            try:
                replica = await self._route(sid)
                return await call(sid, replica.client)
            except AttndError as e:
                if follows < 2 and self._learn_move(sid, e):
                    sid, follows = self._routing.current(sid), follows + 1
                    continue
                if _moving(e) and time.monotonic() + pause < deadline:
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, _MOVING_PAUSE_MAX)
                    continue
                if (follows < 2 and (replica is None or _unreached(e))
                        and await self._find_moved(sid, replica, deadline)):
                    sid, follows = self._routing.current(sid), follows + 1
                    continue
                raise

    def _learn_move(self, session_id: str, e: AttndError) -> bool:
        from . import aio

        return self._routing.learn_move(
            session_id, e, lambda ep: aio.Client(ep.address, **self._routing.options_for(ep)))

    async def _find_moved(self, session_id: str, unreached: Optional[_Replica],
                          deadline: float) -> bool:
        """As SessionClient._find_moved."""
        if self._routing.due(self._routing.min_refresh_interval):
            try:
                await self.refresh()
            except AttndError:
                pass
        for r in self._routing.others(unreached):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await r.client.truncate_session(session_id, 0,
                                                min(left, self._routing.info_timeout))
            except AttndError as e:
                if self._learn_move(session_id, e):
                    return True
        return False

    async def create_session(self, num_layers: int, num_kv_heads: int, head_dim: int,
                             dtype: Any = "bfloat16", max_tokens: int = 0,
                             timeout: Optional[float] = None, *, cache_dtype: Any = None,
                             k_scales: Any = None, v_scales: Any = None) -> Any:
        if self._routing.due(self._routing.refresh_interval):
            try:
                await self.refresh()
            except AttndError:
                pass
        with self._routing.lock:
            replicas = list(self._routing.replicas)
        ranked = self._routing.rank(replicas, await self._ask_all([r.client for r in replicas]))
        attempts = _Placement(self._routing)
        for r, name in ranked:
            try:
                s = await r.client.create_session(num_layers, num_kv_heads, head_dim, dtype,
                                                  max_tokens, timeout, cache_dtype=cache_dtype,
                                                  k_scales=k_scales, v_scales=v_scales)
            except AttndError as e:
                attempts.failed(name, e)
                continue
            attempts.placed(r, s)
            return s
        attempts.raise_exhausted()

    async def session(self, session_id: str) -> Any:
        return (await self._route(session_id)).client.session(session_id)

    async def step(self, session: Any, layer: int, q: Any, k_new: Any, v_new: Any,
                   **options: Any) -> _core.StepResult:
        return await self._on_session(
            _core.session_id_of(session), options.get("timeout"),
            lambda sid, c: c.step(sid, layer, q, k_new, v_new, **options))

    async def batch_step(self, items: Sequence[Any], *, timeout: Optional[float] = None,
                         return_exceptions: bool = False) -> List[Any]:
        routed: Dict[str, Any] = {}
        for raw in items:
            sid = _core.session_id_of(_core.as_step_item(raw).session)
            if sid not in routed:
                try:
                    routed[sid] = await self._route(sid)
                except AttndError as e:
                    routed[sid] = e

        def route(sid: str) -> Any:
            r = routed[sid]
            if isinstance(r, AttndError):
                raise r
            return r
        results, groups = _group(items, route)
        unrouted = {i for i, r in enumerate(results) if r is not None}  # no replica known

        sent = [_current_item(self._routing, x) for x in items]

        async def send(group: Tuple[_Replica, List[int]]) -> Any:
            try:
                return await group[0].client.batch_step([sent[i] for i in group[1]],
                                                        timeout=timeout, return_exceptions=True)
            except AttndError as e:
                return e
        answers = await asyncio.gather(*(send(g) for g in groups))
        for (replica, idx), answer in zip(groups, answers):
            for j, i in enumerate(idx):
                results[i] = answer if isinstance(answer, AttndError) else answer[j]
        for i, r in enumerate(results):
            if _moved_to(r) is not None or _moving(r) or _unreached(r) or i in unrouted:
                item = _core.as_step_item(items[i])

                async def again(sid: str, c: Any, item: Any = item) -> Any:
                    return (await c.batch_step([replace(item, session=sid)], timeout=timeout))[0]
                try:
                    results[i] = await self._on_session(_core.session_id_of(item.session), timeout,
                                                        again)
                except BatchStepError as e:
                    results[i] = e.results[0]
                except AttndError as e:
                    results[i] = e
        if not return_exceptions and any(isinstance(r, AttndError) for r in results):
            raise BatchStepError(results)
        return results

    async def truncate_session(self, session_id: str, tokens: int,
                               timeout: Optional[float] = None) -> _core.TruncateResult:
        return await self._on_session(session_id, timeout,
                                      lambda sid, c: c.truncate_session(sid, tokens, timeout))

    async def fork_session(self, session_id: str, timeout: Optional[float] = None) -> Any:
        return await self._on_session(session_id, timeout,
                                      lambda sid, c: c.session(sid).fork(timeout))

    async def close_session(self, session_id: str, timeout: Optional[float] = None) -> int:
        return await self._on_session(session_id, timeout,
                                      lambda sid, c: c.close_session(sid, timeout))

    async def close(self) -> None:
        for r in self._routing.replicas + self._routing.followed:
            await r.client.close()

    async def __aenter__(self) -> "AsyncSessionClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
