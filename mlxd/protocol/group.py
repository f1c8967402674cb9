"""`[models.NAME] distributed`: a model served by a group of engine processes, one a rank, its
weights split between them with mx.distributed (docs/distributed.md)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Annotated, Literal

import msgspec


class GroupSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    ranks: Annotated[int, msgspec.Meta(ge=2, le=16)]
    backend: Literal["ring", "nccl"] = "ring"  # ring: TCP (CPU, Macs); nccl: NVIDIA GPUs, one a rank
    mode: Literal["tensor", "pipeline"] = "tensor"
    hosts: list[str] | None = None  # other machines' ranks: not served yet

    def __post_init__(self) -> None:
        if self.hosts is not None:
            raise ValueError("ranks on other machines are not served yet (docs/distributed.md): leave `hosts` "
                             "out to run every rank on this machine")

    def flags(self, control: Path) -> list[str]:
        """An engine's flags for a rank of this group (`control`: rank 0's control socket)."""
        return ["--group-control", str(control), "--group-backend", self.backend, "--group-mode", self.mode]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(spec: GroupSpec, hostfile: Path, nccl_port: int, rank: int) -> dict[str, str]:
    """What mx.distributed reads in a rank of the group on this machine: its rank and its peers
    (ring: a hostfile of their addresses; NCCL: rank 0's address, and one GPU a rank)."""
    if spec.backend == "nccl":
        return {"MLX_RANK": str(rank), "MLX_WORLD_SIZE": str(spec.ranks), "NCCL_HOST_IP": "127.0.0.1",
                "NCCL_PORT": str(nccl_port), "CUDA_VISIBLE_DEVICES": str(rank)}
    return {"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}


def write_hostfile(path: Path, ranks: int) -> None:
    """The ring backend's hostfile: one free local port a rank."""
    path.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(ranks)]))
    path.chmod(0o600)
