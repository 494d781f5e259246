"""A real vLLM ``Scheduler`` with ``LeylineConnector`` loaded through ``kv_connector_module_path``,
a worker-role connector over real CPU attention layers' KV tensors, and a stand-in forward
that writes each scheduled token's K and V with the backend's own cache write."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from leyline.vllm.connector import LeylineConnector, order_hints
from leyline.vllm.kv_layout import RowShape, backend_cache_write
from leyline.vllm.link import Order
from leyline.vllm.sources import BlockSources

from ._cpu_attention import cpu_attention_layer, kv_cache

ROWS = RowShape(block_size=32, num_kv_heads=2, head_size=64)
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
NUM_BLOCKS = 16  # block 0 is vLLM's null block
ROPE_THETA = 10000.0
_request_ids = itertools.count()

_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": ROWS.num_kv_heads,
    "head_dim": ROWS.head_size,
    "num_hidden_layers": len(LAYERS),
    "vocab_size": 4096,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": ROPE_THETA,
    "torch_dtype": "float32",
}


def vllm_config(model_dir: Path) -> VllmConfig:
    """A config for a tiny llama (config only, no weights) with the Leyline connector."""
    (model_dir / "config.json").write_text(json.dumps(_TINY_LLAMA))
    model = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=1024
    )
    config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=ROWS.block_size, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=1024,
            max_model_len=1024,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="LeylineConnector",
            kv_connector_module_path="leyline.vllm.connector",
            kv_role="kv_both",
        ),
    )
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return config


def kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=ROWS.block_size,
        num_kv_heads=ROWS.num_kv_heads,
        head_size=ROWS.head_size,
        dtype=torch.float32,
    )
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )


def rope_from_scratch(raw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Keys ``raw`` ``[n, heads, dim]`` rotated to ``positions`` (neox halves), all in fp64."""
    half = ROWS.head_size // 2
    inv_freq = ROPE_THETA ** (-torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half))
    angles = positions.double()[:, None, None] * inv_freq
    a, b = raw.double()[..., :half], raw.double()[..., half:]
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).float()


class Engine:
    """The scheduler and one worker, stepped by hand as the engine core steps them."""

    def __init__(self, config: VllmConfig) -> None:
        self.config = config
        self.scheduler = Scheduler(
            config,
            kv_cache_config(),
            StructuredOutputManager(config),
            block_size=ROWS.block_size,
            hash_block_size=ROWS.block_size,
        )
        self.layers = {name: cpu_attention_layer(torch.float32, ROWS) for name in LAYERS}
        config.compilation_config.static_forward_context = dict(self.layers)
        worker = KVConnectorFactory.create_connector(
            config, KVConnectorRole.WORKER, kv_cache_config()
        )
        assert isinstance(worker, LeylineConnector)
        self.worker = worker
        self.caches = {name: kv_cache(NUM_BLOCKS, ROWS, torch.float32) for name in LAYERS}
        self.worker.register_kv_caches(self.caches)
        generator = torch.Generator().manual_seed(0)
        shape = (4096, ROWS.num_kv_heads, ROWS.head_size)
        self.raw_keys = torch.randn(shape, generator=generator)
        """Per token id, its key before rope (the stand-in model's projection)."""
        self.values = torch.randn(shape, generator=generator)

    @property
    def connector(self) -> LeylineConnector:
        connector = self.scheduler.connector
        assert isinstance(connector, LeylineConnector)
        return connector

    def add(
        self, tokens: Sequence[int], salt: str | None = None, order: Order | None = None
    ) -> Request:
        request = Request(
            f"r{next(_request_ids)}",
            list(tokens),
            SamplingParams(max_tokens=1),
            None,
            cache_salt=salt,
            block_hasher=get_request_block_hasher(ROWS.block_size, get_hash_fn_by_name("sha256")),
            kv_hints=None if order is None else order_hints(order),
        )
        self.scheduler.add_request(request)
        return request

    def load(self, output: SchedulerOutput) -> None:
        """The worker's connector before the forward, as the model runner drives it."""
        self.worker.bind_connector_metadata(output.kv_connector_metadata)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]

    def forward(self, output: SchedulerOutput) -> None:
        """Write K (rope at its position) and V of every scheduled token, as attention does."""
        for new in output.scheduled_new_reqs:
            request = self.scheduler.requests[new.req_id]
            first = new.num_computed_tokens
            count = output.num_scheduled_tokens[new.req_id]
            positions = torch.arange(first, first + count)
            ids = torch.tensor(request.all_token_ids[first : first + count])
            blocks = torch.tensor(new.block_ids[0])[positions // ROWS.block_size]
            slots = blocks * ROWS.block_size + positions % ROWS.block_size
            keys = rope_from_scratch(self.raw_keys[ids], positions)
            for name in LAYERS:
                backend_cache_write(self.layers[name])(
                    keys, self.values[ids], self.caches[name], slots
                )

    def finish_step(self, output: SchedulerOutput) -> dict[str, EngineCoreOutput]:
        """The worker's connector after the forward, then one sampled token per request."""
        connector_output = KVConnectorOutput(
            invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=self.worker.build_connector_worker_meta(),
        )
        self.worker.clear_connector_metadata()
        ids = list(output.num_scheduled_tokens)
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=None if connector_output.is_empty() else connector_output,
        )
        outputs = self.scheduler.update_from_output(output, runner)
        return {o.request_id: o for batch in outputs.values() for o in batch.outputs}

    def step(self) -> tuple[SchedulerOutput, dict[str, EngineCoreOutput]]:
        output = self.scheduler.schedule()
        self.load(output)
        self.forward(output)
        return output, self.finish_step(output)

    def sources(self) -> BlockSources:
        """Independent of the connector's: the same pool, looked up afresh."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return BlockSources.for_cache(kv_cache_config(), "sha256", pool)
