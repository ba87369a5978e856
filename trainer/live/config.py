"""Settings of live recovery: where the lighthouse is, how fast a lost replica group is
dropped from the quorum, and when the job gives up on live recovery for a ckpt resume.

Plain values only (no torch): the supervisor and the lighthouse read them without
importing torch.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import sys

#: Environment variable with the job's heal key (hex); every replica group of a job needs
#: the same one. :class:`trainer.live.supervisor.LiveJob` makes one per job.
LIVE_KEY_ENV = "CKPT_LIVE_KEY"

#: Set (to "1") in a warm spare's environment: :meth:`LiveConfig.from_env` then waits
#: for the supervisor to name the group on the spare's stdin (imports already paid).
SPARE_ENV = "CKPT_LIVE_SPARE"

#: Exit status of a replica group that lost the quorum for good (the lighthouse beyond the
#: retry window, or too few replicas for ``quorum_timeout``): restart the whole job, which
#: resumes from ckpt's newest good step.
EXIT_QUORUM_LOST = 76


@dataclasses.dataclass(frozen=True)
class LiveConfig:
    """How the replica groups of a live job find each other and survive losses.

    Args:
        lighthouse: ``host:port`` of the lighthouse (:mod:`trainer.live.lighthouse`).
        host: this replica group's address on the job's network: the heal server binds
            it and the manager advertises it (never ``0.0.0.0``).
        replica_group: this group's number, ``0 .. replica_groups-1``; its identity in the
            quorum, its RNG streams and its checkpoint folder.
        replica_groups: how many groups the job runs when whole.
        group_rank: this process's rank inside its replica group, ``0 .. group_size-1``.
        group_size: processes per replica group. Inside a group they form a local gloo
            process group (gradients averaged over it, checkpoints written together);
            across groups each rank meets the ranks of the same index in the other groups
            (its share of the gradient all-reduce, its heal). A group that loses one
            rank is lost as a whole.
        group_store: ``host:port`` of the group's c10d store, hosted by group rank 0
            (a process of a group of several ranks needs it; with one rank a free port
            is taken; the supervisor's own config leaves it out).
        min_replicas: fewest groups that may commit a step (default: a majority). Below
            it the survivors wait for replacements up to ``quorum_timeout`` per try.
        heartbeat_timeout: seconds of silence after which the lighthouse drops a group
            from the next quorum; the survivors' next step comes about this long after a
            loss (a lighthouse setting: :class:`LighthouseSettings` takes it from here).
        quorum_timeout: seconds one step's quorum may take (waiting for enough groups, or
            for a restarted lighthouse): the retry window. A group still without a quorum
            then leaves with :data:`EXIT_QUORUM_LOST`.
        quorum_retries: times the group's manager asks the lighthouse again within
            ``quorum_timeout`` after a failed request (spread evenly over it): a
            lighthouse restarted within the window costs no step.
        start_timeout: seconds a process's first quorum may take (the job's groups
            starting, importing torch).
        join_timeout: seconds the lighthouse holds a quorum for a group that heartbeats
            but has not asked yet (a replacement starting): longer stalls the survivors,
            shorter lets a slow replacement join one step later.
        timeout: seconds for the gradient all-reduce, the commit vote and a heal transfer.
        heartbeat_interval: seconds between a group's heartbeats to the lighthouse.
    """

    lighthouse: str
    host: str = "127.0.0.1"
    replica_group: int = 0
    replica_groups: int = 1
    group_rank: int = 0
    group_size: int = 1
    group_store: str | None = None
    min_replicas: int | None = None
    heartbeat_timeout: float = 5.0
    quorum_timeout: float = 30.0
    quorum_retries: int = 3
    start_timeout: float = 60.0
    join_timeout: float = 5.0
    timeout: float = 10.0
    heartbeat_interval: float = 0.1

    def __post_init__(self) -> None:
        if is_wildcard(self.host):
            raise ValueError(f"host must be this group's address on the job's network, not "
                             f"{self.host!r}: the heal server would listen on every "
                             f"interface")
        if ":" not in self.lighthouse:
            raise ValueError(f"lighthouse must be host:port, not {self.lighthouse!r}")
        if self.replica_groups < 1 or not 0 <= self.replica_group < self.replica_groups:
            raise ValueError(f"replica_group {self.replica_group} is not one of "
                             f"0..{self.replica_groups - 1}")
        if self.group_size < 1 or not 0 <= self.group_rank < self.group_size:
            raise ValueError(f"group_rank {self.group_rank} is not one of "
                             f"0..{self.group_size - 1}")
        if self.group_store is not None and ":" not in self.group_store:
            raise ValueError(f"group_store must be host:port, not {self.group_store!r}")
        if not 1 <= self.quorum_size <= self.replica_groups:
            raise ValueError(f"min_replicas must be 1..{self.replica_groups}, not "
                             f"{self.min_replicas}")
        for name in ("heartbeat_timeout", "quorum_timeout", "start_timeout", "join_timeout",
                     "timeout", "heartbeat_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.quorum_timeout <= self.timeout:
            # A group that errs before the all-reduce skips it; its peers wait there for
            # up to `timeout` while it already waits for the next quorum.
            raise ValueError(f"quorum_timeout ({self.quorum_timeout}) must exceed timeout "
                             f"({self.timeout}): a group waits for the next quorum while "
                             f"its peers may still wait out a failed all-reduce")
        if self.quorum_retries < 0:
            raise ValueError("quorum_retries must be >= 0")

    @property
    def quorum_size(self) -> int:
        """The fewest replica groups that commit a step."""
        return self.min_replicas or self.replica_groups // 2 + 1

    @classmethod
    def from_env(cls, **overrides: object) -> LiveConfig:
        """The config a :class:`trainer.live.supervisor.LiveJob` hands its groups
        (``CKPT_LIVE_*`` variables), with ``overrides`` on top. A warm spare
        (:data:`SPARE_ENV`) first waits here for its group number on stdin."""
        take_assignment()
        env = os.environ
        values: dict[str, object] = {
            "lighthouse": env.get("CKPT_LIVE_LIGHTHOUSE", ""),
            "host": env.get("CKPT_LIVE_HOST", "127.0.0.1"),
            "replica_group": int(env.get("CKPT_LIVE_GROUP", "0")),
            "replica_groups": int(env.get("CKPT_LIVE_GROUPS", "1")),
            "group_rank": int(env.get("CKPT_LIVE_GROUP_RANK", "0")),
            "group_size": int(env.get("CKPT_LIVE_GROUP_SIZE", "1")),
            "group_store": env.get("CKPT_LIVE_GROUP_STORE") or None,
        }
        for name, kind in (("min_replicas", int), ("heartbeat_timeout", float),
                           ("quorum_timeout", float), ("quorum_retries", int),
                           ("start_timeout", float), ("join_timeout", float),
                           ("timeout", float)):
            raw = env.get(f"CKPT_LIVE_{name.upper()}")
            if raw:
                values[name] = kind(raw)
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]

    def to_env(self) -> dict[str, str]:
        """The ``CKPT_LIVE_*`` variables :meth:`from_env` reads (the group, the rank and
        the group's store left out: they differ by process)."""
        env = {"CKPT_LIVE_LIGHTHOUSE": self.lighthouse, "CKPT_LIVE_HOST": self.host,
               "CKPT_LIVE_GROUPS": str(self.replica_groups),
               "CKPT_LIVE_GROUP_SIZE": str(self.group_size)}
        for name in ("min_replicas", "heartbeat_timeout", "quorum_timeout",
                     "quorum_retries", "start_timeout", "join_timeout", "timeout"):
            value = getattr(self, name)
            if value is not None:
                env[f"CKPT_LIVE_{name.upper()}"] = str(value)
        return env


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` listens on every interface: empty, or a numeric address
    that bind() reads as 0.0.0.0 or :: ('0', '0x0', '::0', '[::]' as well), or as the
    IPv4-mapped 0.0.0.0 ('::ffff:0.0.0.0', '::ffff:0:0': every IPv4 interface)."""
    literal = host.strip().removeprefix("[").removesuffix("]")
    if not literal:
        return True
    try:  # glibc's reading, as bind() does: '0' and '0.0' are 0.0.0.0 too
        address = socket.getaddrinfo(literal, None, flags=socket.AI_NUMERICHOST)[0][4][0]
    except (socket.gaierror, UnicodeError):
        return False  # a host name: resolved to this host's address, never a wildcard
    parsed = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(parsed, "ipv4_mapped", None)
    return parsed.is_unspecified or (mapped is not None and mapped.is_unspecified)


def assignment(group: int, rank: int = 0, store: str | None = None) -> str:
    """The line that makes a warm spare rank ``rank`` of ``group`` (see
    :func:`take_assignment`)."""
    return f"{group} {rank} {store or '-'}\n"


def take_assignment() -> None:
    """In a warm spare, block until the supervisor names the group, the rank in it and the
    group's store (one line on stdin: :func:`assignment`), then become that process;
    elsewhere, nothing."""
    if os.environ.get(SPARE_ENV) != "1":
        return
    line = sys.stdin.readline()
    if not line.strip():
        os._exit(0)  # the supervisor is gone or let the spare go
    fields = line.split()
    os.environ["CKPT_LIVE_GROUP"] = str(int(fields[0]))
    if len(fields) > 1:
        os.environ["CKPT_LIVE_GROUP_RANK"] = str(int(fields[1]))
    if len(fields) > 2 and fields[2] != "-":
        os.environ["CKPT_LIVE_GROUP_STORE"] = fields[2]
    os.environ.pop(SPARE_ENV)


__all__ = ["EXIT_QUORUM_LOST", "LIVE_KEY_ENV", "SPARE_ENV", "LiveConfig", "assignment",
           "is_wildcard", "take_assignment"]
