"""`[models.NAME] distributed`: a model served by a group of engine processes, one a rank, its
weights split between them with mx.distributed (docs/distributed.md)."""

from __future__ import annotations

import ipaddress
import json
import socket
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from mlxd.protocol.rank_agent import split_host


class GroupSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    ranks: Annotated[int, msgspec.Meta(ge=2, le=16)]
    backend: Literal["ring", "nccl"] = "ring"  # ring: TCP (CPU, Macs); nccl: NVIDIA GPUs, one a rank
    mode: Literal["tensor", "pipeline"] = "tensor"
    # One host a rank: this machine's address on the link the ranks share first, then the
    # addresses (IP or IP:PORT) of `mlxd rank` on the others. None: every rank on this machine.
    hosts: list[str] | None = None
    key_file: str | None = None  # the key the hosts share (default: rank.key in mlxd's data dir)

    def __post_init__(self) -> None:
        if self.mode == "pipeline" and self.backend == "nccl":
            raise ValueError("MLX's NCCL backend has no send and receive, which a pipeline needs: use mode = "
                             "\"tensor\" with NCCL")
        if self.hosts is not None:
            for entry in self.hosts:
                try:
                    ipaddress.ip_address(split_host(entry)[0])
                except ValueError:
                    raise ValueError(f"`hosts` entries are IP addresses (IP or IP:PORT): not {entry!r}") from None
            if len(self.hosts) != self.ranks:
                raise ValueError(f"`hosts` names one host a rank: {len(self.hosts)} hosts for {self.ranks} ranks")
            if ":" in self.hosts[0]:
                raise ValueError(f"`hosts` starts with this machine's own IP address, no port: not {self.hosts[0]!r}")

    def flags(self, control: str) -> list[str]:
        """An engine's flags for a rank of this group (`control`: rank 0's control socket, a path
        or tcp://IP:PORT)."""
        return ["--group-control", control, "--group-backend", self.backend, "--group-mode", self.mode]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_env(spec: GroupSpec, hostfile: Path, nccl_port: int, rank: int) -> dict[str, str]:
    """What mx.distributed reads in a rank of the group: its rank and its peers (ring: a
    hostfile of their addresses; NCCL: rank 0's address, and one GPU a rank on one machine)."""
    if spec.backend == "nccl":
        return {"MLX_RANK": str(rank), "MLX_WORLD_SIZE": str(spec.ranks),
                "NCCL_HOST_IP": spec.hosts[0] if spec.hosts else "127.0.0.1", "NCCL_PORT": str(nccl_port),
                "CUDA_VISIBLE_DEVICES": "0" if spec.hosts else str(rank)}
    return {"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}


def hostfile_text(addresses: list[str]) -> str:
    """The ring backend's hostfile: one `IP:PORT` a rank."""
    return json.dumps([[address] for address in addresses])


def write_hostfile(path: Path, ranks: int) -> None:
    """A hostfile of one free local port a rank."""
    path.write_text(hostfile_text([f"127.0.0.1:{free_port()}" for _ in range(ranks)]))
    path.chmod(0o600)
