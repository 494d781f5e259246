"""``LeylineConnector``: the KV connector vLLM loads by ``--kv-transfer-config
'{"kv_connector": "LeylineConnector", "kv_connector_module_path": "leyline.vllm.connector",
"kv_role": "kv_both"}'``, built once per role. It only delegates: the engine core's hooks to
``scheduler_side``, the worker's to ``worker_side``. Orders come only from ``kv_hints``
(:func:`order_hints`); ``kv_transfer_params`` from a body are never read.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

from leyline.core.errors import SpliceUnsupportedError
from leyline.engine.rope_band import RopeBand, common_band
from leyline.protocol.fallback import FallbackReason
from leyline.vllm.kv_layout import RowShape, backend_cache_write
from leyline.vllm.link import ANSWER_KEY, ORDER_ACTION, ORDER_VERSION, Order, RowMoves
from leyline.vllm.rope_source import band_of
from leyline.vllm.scheduler_side import SchedulerSide
from leyline.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

PROTOCOL_VERSION = "leyline/1"


def order_hints(order: Order) -> KvHintsEnvelope:
    """The ``kv_hints`` carrying ``order`` on a request the backend runs itself."""
    action = KvHintAction(uuid.uuid4().hex, ORDER_ACTION, ORDER_VERSION, order.to_payload())
    return KvHintsEnvelope(PROTOCOL_VERSION, uuid.uuid4().hex, [action])


@dataclass
class LeylineMetadata(KVConnectorMetadata):  # type: ignore[misc,unused-ignore]
    """One step's rows, scheduler to workers (pickled)."""

    moves: RowMoves = field(default_factory=RowMoves)


@dataclass
class LoadsRun(KVConnectorWorkerMetadata):  # type: ignore[misc,unused-ignore]
    """Workers to scheduler: loads were run this step; ``refusal`` (reason, message) when a
    worker wrote none of them."""

    refusal: tuple[str, str] | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, LoadsRun)
        return self if self.refusal is not None else other


def _model_band() -> RopeBand:
    """The band of every rotary module this process built (vLLM caches each one ``get_rope``
    returns; the worker has built its model before its KV caches are registered)."""
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT

    return common_band(band_of(rotary) for rotary in _ROPE_DICT.values())


class LeylineConnector(KVConnectorBase_V1):  # type: ignore[misc,unused-ignore]
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            hash_algo = vllm_config.cache_config.prefix_caching_hash_algo
            self._scheduler = SchedulerSide(kv_cache_config, hash_algo)
        else:
            self._worker = WorkerSide()

    # -- engine core ------------------------------------------------------------------

    @property
    def scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side hook on the worker's connector"
        return self._scheduler

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self.scheduler_side.bind(gpu_block_pool)

    def on_new_request(self, request: Request) -> None:
        self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        block_ids = list(blocks.get_block_ids()[0]) if num_external_tokens else []
        self.scheduler_side.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return LeylineMetadata(self.scheduler_side.build_connector_meta())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        ran = connector_output.kv_connector_worker_meta
        if isinstance(ran, LoadsRun):
            refused = None
            if ran.refusal is not None:
                refused = SpliceUnsupportedError(FallbackReason(ran.refusal[0]), ran.refusal[1])
            self.scheduler_side.loads_done(refused)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        answer = self.scheduler_side.request_finished(request, block_ids)
        return False, None if answer is None else {ANSWER_KEY: answer.to_payload()}

    # -- worker -----------------------------------------------------------------------

    @property
    def worker_side(self) -> WorkerSide:
        assert self._worker is not None, "a worker hook on the scheduler's connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        rows = RowShape(int(spec.block_size), int(spec.num_kv_heads), int(spec.head_size))
        layers = self._vllm_config.compilation_config.static_forward_context

        def write_of(name: str) -> Any:
            layer = layers.get(name)
            if layer is None or not hasattr(layer, "impl"):
                raise SpliceUnsupportedError(
                    FallbackReason.unsupported_layout, f"no attention layer {name!r}"
                )
            return backend_cache_write(layer)

        self.worker_side.register(kv_caches, write_of, rows, _model_band)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if isinstance(metadata, LeylineMetadata):
            self.worker_side.load(metadata.moves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        ran = self.worker_side.take_steps_run()
        if not ran:
            return None
        refused = next((r for r in ran if r is not None), None)
        return LoadsRun(None if refused is None else (refused.reason.value, refused.message))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are written before the forward

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # vLLM's prefix cache keeps what the connector reads

    def wait_for_save(self) -> None:
        return
