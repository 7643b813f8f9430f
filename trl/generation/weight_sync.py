"""Process groups that carry weights from a trainer to vLLM workers, on CUDA (NCCL) and on CPU (gloo).

Both sides of a weight push (the `VLLMClient` in the trainer and the worker extension inside `trl vllm-serve`) build
the same kind of group: `world_size` ranks, the vLLM workers first and the trainer last, rendezvousing through a TCP
store served by rank 0 (a vLLM worker) on `host:port`. The group is independent of any default
`torch.distributed` process group the trainer or vLLM may already have.

- `"nccl"`: vLLM's `StatelessProcessGroup` plus `PyNcclCommunicator`; tensors stay on the GPU. Needs vLLM on both
  sides and two different GPUs for the two ends.
- `"gloo"`: a plain `torch.distributed.ProcessGroupGloo` over the same kind of TCP store; tensors go through host
  memory. Needs nothing but torch, so a CPU-only trainer can push weights to a CPU (or GPU) server.

Several tensors can travel in one collective: [`pack_tensors`] flattens them into one byte buffer and
[`unpack_tensors`] cuts it back into named tensors of the announced dtypes and shapes.
"""

import datetime
import ipaddress
from collections.abc import Sequence

import torch


WEIGHT_SYNC_BACKENDS = ("nccl", "gloo")

# How long every rank waits for the others (rendezvous and each collective).
DEFAULT_TIMEOUT_S = 600.0


def is_loopback_host(host: str) -> bool:
    """Whether `host` names this machine's loopback interface (`localhost`, `127.x.y.z`, `::1`)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def dtype_from_string(name: str) -> torch.dtype:
    """`torch.float32` for `"torch.float32"` or `"float32"`.

    Raises:
        ValueError: When the name is not a torch dtype.
    """
    attribute = name.split(".")[-1]
    dtype = getattr(torch, attribute, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Expected a torch dtype name such as 'torch.bfloat16', got {name!r}.")
    return dtype


def pack_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate the raw bytes of `tensors` into one contiguous `uint8` tensor (on the first tensor's device)."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(flat) if len(flat) > 1 else flat[0].clone()


def unpack_tensors(
    buffer: torch.Tensor, metadata: Sequence[tuple[str, torch.dtype, Sequence[int]]]
) -> list[tuple[str, torch.Tensor]]:
    """Cut a buffer made by [`pack_tensors`] back into `(name, tensor)` pairs.

    Args:
        buffer: One-dimensional `uint8` tensor.
        metadata: `(name, dtype, shape)` of each packed tensor, in packing order.

    Returns:
        Views into `buffer`, one per entry of `metadata`.
    """
    sizes = []
    for _, dtype, shape in metadata:
        numel = 1
        for size in shape:
            numel *= int(size)
        sizes.append(numel * torch.empty(0, dtype=dtype).element_size())
    if sum(sizes) != buffer.numel():
        raise ValueError(
            f"Expected a packed buffer of {sum(sizes)} bytes for {len(metadata)} tensors, got {buffer.numel()}."
        )
    out = []
    offset = 0
    for (name, dtype, shape), nbytes in zip(metadata, sizes):
        chunk = buffer[offset : offset + nbytes]
        if offset % torch.empty(0, dtype=dtype).element_size():
            # Reinterpreting bytes needs an offset aligned to the element size: copy the misaligned slice.
            chunk = chunk.clone()
        out.append((name, chunk.view(dtype).reshape(tuple(shape))))
        offset += nbytes
    return out


class WeightSyncGroup:
    """A process group of `world_size` ranks used only to broadcast weights.

    Build it with [`create_weight_sync_group`].

    Args:
        backend: `"nccl"` or `"gloo"`.
        rank: This process's rank.
        world_size: Number of ranks (vLLM workers plus the trainer).
        device: Device tensors must live on for `broadcast` (`cpu` for gloo).
        process_group: The gloo process group (gloo only).
        store: The TCP store behind the group (kept alive with the group).
        communicator: vLLM's `PyNcclCommunicator` (NCCL only).
        stateless_group: vLLM's `StatelessProcessGroup` (NCCL only).
    """

    def __init__(
        self,
        backend: str,
        rank: int,
        world_size: int,
        device: torch.device,
        process_group=None,
        store=None,
        communicator=None,
        stateless_group=None,
    ):
        self.backend = backend
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self._process_group = process_group
        self._store = store
        self._communicator = communicator
        self._stateless_group = stateless_group

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Broadcast `tensor` in place from rank `src` to every rank (the tensor must be on `self.device`)."""
        if self.backend == "nccl":
            self._communicator.broadcast(tensor, src=src)
            torch.cuda.current_stream(self.device).synchronize()
        else:
            self._process_group.broadcast(tensor, src).wait()

    def barrier(self) -> None:
        """Wait until every rank has reached this point."""
        if self.backend == "nccl":
            self._stateless_group.barrier()
        else:
            self._process_group.barrier().wait()

    def close(self) -> None:
        """Release the group (the other ranks should close theirs too)."""
        self._communicator = None
        self._stateless_group = None
        self._process_group = None
        self._store = None


def default_backend(device: torch.device | str | int | None) -> str:
    """`"nccl"` for a CUDA device, `"gloo"` otherwise."""
    if isinstance(device, int):
        return "nccl" if torch.cuda.is_available() else "gloo"
    if device is None:
        return "gloo"
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def create_weight_sync_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    device: torch.device | str | int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> WeightSyncGroup:
    """Join (rank 0: open) the weight-transfer group on `host:port`.

    Every rank must call this with the same `host`, `port`, `world_size` and `backend`; the call returns once all
    ranks have joined.

    Args:
        host: Address of rank 0's TCP store. Rank 0 binds to it (`"0.0.0.0"` listens on every interface); the other
            ranks connect to it.
        port: Port of the TCP store.
        rank: Rank of this process, in `[0, world_size)`.
        world_size: Number of ranks.
        backend: `"nccl"` (CUDA tensors, needs vLLM) or `"gloo"` (CPU tensors, plain torch).
        device: CUDA device for NCCL; ignored for gloo.
        timeout_s: Seconds to wait for the rendezvous and for each collective.

    Returns:
        [`WeightSyncGroup`]: The joined group.

    Raises:
        ValueError: On an unknown backend or a rank outside `[0, world_size)`.
    """
    if backend not in WEIGHT_SYNC_BACKENDS:
        raise ValueError(f"Expected a weight-sync backend in {WEIGHT_SYNC_BACKENDS}, got {backend!r}.")
    if not 0 <= rank < world_size:
        raise ValueError(f"Expected a rank in [0, {world_size}), got {rank}.")

    if backend == "nccl":
        try:
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup
        except ImportError as e:
            raise ImportError(
                "NCCL weight synchronisation needs vLLM in the trainer's environment: `pip install trl[vllm]`."
            ) from e
        cuda_device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
        communicator = PyNcclCommunicator(group, device=cuda_device)
        return WeightSyncGroup(
            backend, rank, world_size, cuda_device, communicator=communicator, stateless_group=group
        )

    timeout = datetime.timedelta(seconds=timeout_s)
    store = torch.distributed.TCPStore(
        host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    options = torch.distributed.ProcessGroupGloo._Options()
    options._timeout = timeout
    # Gloo publishes the address of the interface it listens on (by default the one the hostname resolves to, or
    # GLOO_SOCKET_IFNAME). For a loopback rendezvous keep everything on loopback: in sandboxes and containers the
    # hostname may resolve to an address the other ranks cannot reach.
    if is_loopback_host(host):
        gloo_device = torch.distributed.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    else:
        gloo_device = torch.distributed.ProcessGroupGloo.create_default_device()
    options._devices = [gloo_device]
    process_group = torch.distributed.ProcessGroupGloo(
        torch.distributed.PrefixStore("trl_weight_sync", store), rank, world_size, options
    )
    return WeightSyncGroup(backend, rank, world_size, torch.device("cpu"), process_group=process_group, store=store)
