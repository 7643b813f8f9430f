"""The vLLM worker extension of `trl vllm-serve`: weight updates pushed by the trainer, loaded inside each worker.

vLLM imports the class by its qualified name, `trl.generation.vllm_worker_extension.WeightSyncWorkerExtension`
(passed as `worker_extension_cls` by `trl.scripts._vllm_engines`), into every worker process and mixes it into the
worker; the server calls its methods through `LLM.collective_rpc`. Importing this module loads neither torch nor
vLLM: the methods import what they use.
"""


class WeightSyncWorkerExtension:
    """Methods added to each vLLM worker so the trainer can push new weights into it.

    The trainer (last rank) broadcasts tensors through a [`~trl.generation.weight_sync.WeightSyncGroup`]; each
    worker loads them with vLLM's in-place reload machinery, which re-runs the per-layer post-processing (weight
    repacking on CPU, quantization, ...) once all of a layer's weights have arrived. The reload is finished by
    `apply_weight_updates`, which the server calls before the next generation.
    """

    _trl_group = None
    _trl_client_rank = None
    _trl_reloading = False

    def init_communicator(
        self,
        host: str,
        port: int,
        world_size: int,
        client_device_uuid: str,
        rank_offset: int = 0,
        backend: str | None = None,
    ) -> None:
        """Join the weight-transfer group as rank `rank_offset + <worker rank>`."""
        import torch

        from trl.generation.weight_sync import create_weight_sync_group, default_backend

        if self._trl_group is not None:
            raise RuntimeError("The weight-transfer group is already open: close it before opening another one.")
        backend = backend or default_backend(self.device)
        if backend == "nccl":
            if self.device.type != "cuda":
                raise RuntimeError(
                    f"NCCL weight transfer needs the vLLM workers on CUDA devices, but this worker runs on "
                    f"{self.device}. Push weights with the gloo backend instead."
                )
            if client_device_uuid == str(torch.cuda.get_device_properties(self.device).uuid):
                raise RuntimeError(
                    "The trainer and the vLLM server share a GPU, which NCCL cannot broadcast between. Put the server "
                    "on other GPUs (e.g. CUDA_VISIBLE_DEVICES) or use vllm_mode='colocate'."
                )
        rank = rank_offset + self.rank
        self._trl_group = create_weight_sync_group(host, port, rank, world_size, backend=backend, device=self.device)
        self._trl_client_rank = world_size - 1

    def _trl_require_group(self):
        if self._trl_group is None:
            raise RuntimeError("No weight-transfer group: the client must call /init_communicator/ first.")
        return self._trl_group

    def update_named_param(self, name: str, dtype: str, shape: list[int]) -> None:
        """Receive one tensor from the trainer and load it under the checkpoint name `name`."""
        import torch

        from trl.generation.weight_sync import dtype_from_string

        group = self._trl_require_group()
        tensor = torch.empty(tuple(shape), dtype=dtype_from_string(dtype), device=group.device)
        group.broadcast(tensor, src=self._trl_client_rank)
        self._trl_load([(name, tensor)])

    def update_named_params(self, params: list[dict], packed_bytes: int) -> None:
        """Receive a packed buffer of several tensors (see `trl.generation.weight_sync.pack_tensors`) and load them."""
        import torch

        from trl.generation.weight_sync import dtype_from_string, unpack_tensors

        group = self._trl_require_group()
        buffer = torch.empty(int(packed_bytes), dtype=torch.uint8, device=group.device)
        group.broadcast(buffer, src=self._trl_client_rank)
        metadata = [(p["name"], dtype_from_string(p["dtype"]), p["shape"]) for p in params]
        self._trl_load(unpack_tensors(buffer, metadata))

    def _trl_load(self, weights: list) -> None:
        model = self.model_runner.model
        try:
            from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload
        except ImportError:
            # Older vLLM: plain in-place loading (enough when weights are used as loaded, e.g. unquantized on GPU).
            model.load_weights(weights=weights)
            return
        if not self._trl_reloading:
            initialize_layerwise_reload(model)
            self._trl_reloading = True
        model.load_weights(weights=weights)

    def apply_weight_updates(self) -> None:
        """Finish an in-place reload started by pushed weights (no-op when nothing was pushed)."""
        if not self._trl_reloading:
            return
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(self.model_runner.model, self.model_runner.model_config)
        self._trl_reloading = False
        for reset in ("reset_encoder_cache", "reset_mm_cache"):
            method = getattr(self.model_runner, reset, None)
            if callable(method):
                method()

    def close_communicator(self) -> None:
        """Apply pending weights and leave the weight-transfer group."""
        self.apply_weight_updates()
        if self._trl_group is not None:
            self._trl_group.close()
            self._trl_group = None
            self._trl_client_rank = None
