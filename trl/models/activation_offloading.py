"""Activation offloading: keep the tensors autograd saves for backward in CPU memory instead of accelerator memory.

Built on `torch.autograd.graph.saved_tensors_hooks`: every tensor saved during the forward pass goes through a pack
hook (which copies large accelerator tensors to host memory, asynchronously when streams are used) and comes back
through an unpack hook during the backward pass (copied back to the original device).
"""

import warnings
import weakref
from collections import deque
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks


class _Packed:
    """What the autograd graph stores instead of a saved tensor."""

    __slots__ = ("device", "event", "tensor")

    def __init__(self, tensor: torch.Tensor, device: torch.device | None, event: Any = None):
        self.tensor = tensor  # host copy, or the (detached) original when it was not offloaded
        self.device = device  # device to restore to; None when the tensor was kept in place
        self.event = event  # CUDA event marking the end of an asynchronous device-to-host copy


class OffloadActivations(saved_tensors_hooks):
    """Context manager that offloads activations saved for backward to CPU memory.

    Tensors of at least `min_offload_size` bytes living on an accelerator are copied to host memory when autograd
    saves them and copied back when the backward pass needs them. Parameters (and views of them) are never offloaded.
    Tensors already on the CPU are kept as they are, so on CPU-only machines the manager is a (cheap) no-op and
    training runs unchanged; set `offload_cpu_tensors = True` to force real copies of CPU tensors as well (useful to
    exercise the copy path without an accelerator).

    Args:
        use_pin_memory: Copy into pinned (page-locked) host memory, which allows asynchronous transfers. Only used when
            CUDA is available.
        use_streams: Run device-to-host copies on a side CUDA stream so they overlap with compute.
        min_offload_size: Smallest tensor size, in bytes, worth offloading.
        max_fwd_stash_size: With streams, at most this many source tensors are kept alive while their copies are in
            flight; beyond that the oldest copy is waited for and its device memory released.
    """

    offload_cpu_tensors: bool = False

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        min_offload_size: int = 1024,
        max_fwd_stash_size: int = 5,
    ):
        if min_offload_size < 0:
            raise ValueError(f"`min_offload_size` must be >= 0 bytes, got {min_offload_size}.")
        if max_fwd_stash_size < 0:
            raise ValueError(f"`max_fwd_stash_size` must be >= 0, got {max_fwd_stash_size}.")
        cuda = torch.cuda.is_available()
        self.use_pin_memory = use_pin_memory and cuda
        self.use_streams = use_streams and cuda
        self.min_offload_size = min_offload_size
        self.max_fwd_stash_size = max_fwd_stash_size
        self._stream = torch.cuda.Stream() if self.use_streams else None
        self._fwd_stash: deque[tuple[torch.Tensor, Any]] = deque()
        self._model_ref: weakref.ref | None = None
        self._param_storages: set[int] = set()
        self.num_offloaded = 0  # statistics, reset on every __enter__
        self.num_kept = 0
        self.head_hook_handles: list = []
        super().__init__(self._pack, self._unpack)

    def track_model(self, model: nn.Module) -> None:
        """Remember `model` so that storages of its parameters are excluded from offloading."""
        self._model_ref = weakref.ref(model)

    def _refresh_parameter_storages(self) -> None:
        model = self._model_ref() if self._model_ref is not None else None
        if model is None:
            self._param_storages = set()
            return
        storages = set()
        for param in model.parameters():
            if param.device.type != "meta":
                storages.add(param.untyped_storage().data_ptr())
        self._param_storages = storages

    def __enter__(self):
        # Parameters may have moved (e.g. to the accelerator) since the last step: recompute their storages.
        self._refresh_parameter_storages()
        self.num_offloaded = 0
        self.num_kept = 0
        return super().__enter__()

    def __exit__(self, *exc_info):
        self._drain_stash(0)
        return super().__exit__(*exc_info)

    def _should_offload(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, nn.Parameter) or tensor.layout != torch.strided:
            return False
        if tensor.device.type == "meta" or (tensor.device.type == "cpu" and not self.offload_cpu_tensors):
            return False
        if tensor.numel() * tensor.element_size() < self.min_offload_size:
            return False
        return tensor.untyped_storage().data_ptr() not in self._param_storages

    def _drain_stash(self, keep: int) -> None:
        while len(self._fwd_stash) > keep:
            _, event = self._fwd_stash.popleft()
            event.synchronize()

    def _pack(self, tensor: torch.Tensor) -> _Packed:
        if not self._should_offload(tensor):
            self.num_kept += 1
            # detach(): the packed object must not reference the tensor's autograd node (reference cycle).
            return _Packed(tensor.detach(), None)
        self.num_offloaded += 1
        device = tensor.device
        if device.type == "cpu":
            return _Packed(tensor.detach().clone(), device)

        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.use_pin_memory)
        if self._stream is not None and device.type == "cuda":
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                host.copy_(tensor, non_blocking=self.use_pin_memory)
                event = torch.cuda.Event()
                event.record(self._stream)
            # Keep the source alive until its copy has finished; bound the number of copies in flight.
            self._fwd_stash.append((tensor.detach(), event))
            self._drain_stash(self.max_fwd_stash_size)
            return _Packed(host, device, event)
        host.copy_(tensor)
        return _Packed(host, device)

    def _unpack(self, packed: _Packed) -> torch.Tensor:
        if packed.device is None:
            return packed.tensor
        if packed.event is not None:
            packed.event.synchronize()
        if packed.device.type == "cpu":
            return packed.tensor
        return packed.tensor.to(packed.device, non_blocking=self.use_pin_memory)


class NoOpManager(saved_tensors_hooks):
    """Saved-tensor hooks that keep tensors where they are.

    Entered inside an [`OffloadActivations`] block (hooks nest, the innermost pair wins), it exempts a region, such as
    the output head, from offloading.
    """

    def __init__(self):
        super().__init__(self._pack, self._unpack)

    @staticmethod
    def _pack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _find_output_head(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        try:
            head = getter()
        except (NotImplementedError, AttributeError):
            head = None
        if isinstance(head, nn.Module):
            return head
    for name in ("lm_head", "embed_out", "output", "score", "classifier"):
        for module_name, module in model.named_modules():
            if module_name.split(".")[-1] == name:
                return module
    return None


def get_act_offloading_ctx_manager(
    model: nn.Module,
    use_pin_memory: bool = True,
    use_streams: bool = True,
    min_offload_size: int = 1024,
    max_fwd_stash_size: int = 5,
    warn_if_no_head: bool = True,
) -> OffloadActivations:
    """Build the activation-offloading context manager used when `activation_offloading=True`.

    The output head (`lm_head` or equivalent) is exempted through a [`NoOpManager`] entered around its forward: its
    activations are needed first in the backward pass, so moving them off the device would only add transfers.

    Args:
        model: Model whose forward pass will run inside the returned context.
        use_pin_memory: Use pinned host memory for the copies.
        use_streams: Overlap copies with compute on a side CUDA stream.
        min_offload_size: Smallest tensor size, in bytes, worth offloading.
        max_fwd_stash_size: Maximum number of device-to-host copies in flight.
        warn_if_no_head: Warn when no output head is found to exempt.

    Returns:
        An [`OffloadActivations`] context manager.
    """
    manager = OffloadActivations(
        use_pin_memory=use_pin_memory,
        use_streams=use_streams,
        min_offload_size=min_offload_size,
        max_fwd_stash_size=max_fwd_stash_size,
    )
    manager.track_model(model)

    head = _find_output_head(model)
    if head is None:
        if warn_if_no_head:
            warnings.warn(
                "No output head (lm_head or similar) was found in the model, so it cannot be exempted from activation "
                "offloading. Offloading still works but may transfer the largest activations needlessly.",
                stacklevel=2,
            )
        return manager

    noop = NoOpManager()

    def enter_noop(module, args):
        noop.__enter__()

    def exit_noop(module, args, output):
        noop.__exit__(None, None, None)

    manager.head_hook_handles = [
        head.register_forward_pre_hook(enter_noop),
        head.register_forward_hook(exit_noop, always_call=True),
    ]
    return manager


__all__ = ["NoOpManager", "OffloadActivations", "get_act_offloading_ctx_manager"]
