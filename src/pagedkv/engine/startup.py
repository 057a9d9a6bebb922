"""Engine startup: load the model, pick its path, size the KV pool, build the runner.

Every rank of a tensor-parallel group runs the same startup (so the same pool and the same
CUDA graphs, captured in lockstep); only the driver (rank 0, or the one process without TP)
builds a scheduler and a tokenizer on top of it.

    load_model_setup   HF model -> own decoder or HF modules; dtype, KV dtype, FP8 scales
    plan_pool          memory budget -> num_blocks (the smallest rank's), max_model_len, host blocks
    build_scheduler    the engine's config and the pool plan -> the driver's Scheduler
    build_runner       KVPool + the host pool and disk tier (KVOffload) + ModelRunner (graph capture)

The pool is sized from a memory budget, and a configuration where one max-length request
could not fit is refused, naming the largest length that does. With an FP8 `kv_cache_dtype`
the budget is counted in one-byte blocks, and the scales are fixed here (checkpoint or
calibration, `pagedkv.hf.kv_scales`) before the model's HF copy is released.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch

from pagedkv.core.block_table import num_blocks_for
from pagedkv.core.kv_groups import FULL_ATTENTION, SLIDING_ATTENTION, KVLayout, group_layers
from pagedkv.core.memory import ModelSpec
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.kv_disk import DiskStore, fingerprint
from pagedkv.engine.kv_offload import KVOffload
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.scheduler_types import SchedulerConfig
from pagedkv.errors import ConfigError
from pagedkv.models.config import attention_shape, kv_shape_of, max_positions
from pagedkv.models.loader import load_model, load_tokenizer, parse_dtype
from pagedkv.kernels import KVPool
from pagedkv.kernels.fp8 import is_fp8, kv_cache_dtype_name, resolve_kv_cache_dtype

logger = logging.getLogger("pagedkv")

CPU_DEFAULT_KV_BYTES = 256 * 2**20


def pick_device(name: str | None) -> torch.device:
    """The engine's device: `name`, or CUDA when torch sees one, else the CPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} was asked for, but torch sees no CUDA device")
    return device


@dataclass
class ModelSetup:
    """The loaded model and what follows from it, alike on every rank."""

    model: torch.nn.Module  # the own decoder, or the HF model with pagedkv attention
    model_impl: str  # "pagedkv" | "hf"
    hf_model: torch.nn.Module | None  # kept on CPU (the demo compares against its generate) and for the HF path
    hf_config: object
    generation_config: object
    tokenizer: object
    dtype: torch.dtype
    vocab_size: int
    kv_dtype: torch.dtype
    kv_scales: object  # KVScales for an FP8 pool, else None
    kv_spec: ModelSpec  # this rank's KV shape (its share of the KV heads) in the pool's bytes
    kv_layout: KVLayout | None = None  # layer groups of a sliding-window model (None: one table, every layer)

    @property
    def eos_token_ids(self) -> list[int]:
        """Every EOS id the generation config and the model config name."""
        ids = set()
        for source in (self.generation_config, self.hf_config):
            eos = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(eos)
        return sorted(ids)


@dataclass(frozen=True)
class PoolPlan:
    """How big the KV pool and the swap space are, and the longest request they allow."""

    num_blocks: int
    block_size: int
    max_model_len: int
    num_swap_blocks: int
    bytes_per_block: int
    num_offload_blocks: int = 0  # host blocks of the KV tiers' host tier (beside the swap blocks)
    disk_capacity_blocks: int = 0  # blocks the disk tier may hold (0: none)

    @property
    def num_host_blocks(self) -> int:
        """The host pool: swap space plus the host tier."""
        return self.num_swap_blocks + self.num_offload_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


def load_model_setup(config: EngineConfig, device: torch.device, tp=None, model: torch.nn.Module | None = None,
                     tokenizer=None, *, is_driver: bool = True) -> ModelSetup:
    """Load (or adopt) the model, fix the KV dtype and scales, and pick the decoder path."""
    if model is None:
        dtype = parse_dtype(config.dtype) if config.dtype else (
            torch.bfloat16 if device.type == "cuda" else torch.float32)
        model = load_model(config.model, dtype, device)
        if tokenizer is None and is_driver:
            tokenizer = load_tokenizer(config.model)
    elif model.config._attn_implementation != "pagedkv":
        model.set_attn_implementation("pagedkv")
    dtype = next(model.parameters()).dtype
    num_layers, num_kv_heads, head_dim = kv_shape_of(model.config)
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device)
    # This rank's heads (the decoder's shard checks that they divide).
    kv_spec = ModelSpec(num_layers, num_kv_heads // config.tensor_parallel_size, head_dim, kv_dtype.itemsize)
    kv_layout = kv_layout_of(model.config, kv_spec) if config.hybrid_kv else None
    kv_scales = None
    if is_fp8(kv_dtype):
        kv_scales = _kv_scales(config, model, tokenizer, kv_dtype, tp, is_driver)
    own, model_impl = _pick_model(config, model, tp)
    # On a GPU the HF weights are freed once the own decoder holds its fused copy.
    hf_model = model if model_impl == "hf" or device.type != "cuda" else None
    setup = ModelSetup(own, model_impl, hf_model, model.config, getattr(model, "generation_config", None),
                       tokenizer, dtype, model.config.get_text_config().vocab_size, kv_dtype, kv_scales, kv_spec,
                       kv_layout)
    if hf_model is None:
        del model
        torch.cuda.empty_cache()
    return setup


def kv_layout_of(hf_config, kv_spec: ModelSpec) -> KVLayout | None:
    """The layer groups of a model with sliding-window layers; None (one table) for any other model.

    A model with layer types other than full and sliding attention keeps one full-length table, and so
    does one whose window is no shorter than its positions (Phi-3.5-mini's 262,144): it never slides.
    """
    shape = attention_shape(hf_config)
    if SLIDING_ATTENTION not in shape.layer_types or \
            not set(shape.layer_types) <= {FULL_ATTENTION, SLIDING_ATTENTION}:
        return None
    if shape.sliding_window >= (max_positions(hf_config) or shape.sliding_window + 1):
        return None
    per_layer = 2 * kv_spec.num_kv_heads * kv_spec.head_dim * kv_spec.dtype_bytes
    return group_layers(shape.layer_types, shape.sliding_window, bytes_per_token_per_layer=per_layer)


def plan_pool(config: EngineConfig, setup: ModelSetup, device: torch.device, tp=None) -> PoolPlan:
    """Blocks from the memory budget (every rank agrees on the smallest), then max_model_len and swap space.

    With layer groups a block holds one group's layers, so the same budget holds more blocks.
    """
    layout = setup.kv_layout
    bytes_per_block = layout.page_size_bytes(config.block_size) if layout is not None else \
        setup.kv_spec.page_size_bytes(config.block_size)
    num_blocks = _num_blocks(config, device, bytes_per_block)
    if tp is not None:
        num_blocks = tp.min_int(num_blocks)  # every rank holds the same block ids: the smallest pool wins
    max_model_len = _max_model_len(config, setup.hf_config, _capacity_tokens(config, layout, num_blocks))
    num_swap_blocks = config.swap_space // bytes_per_block if config.preemption_mode == "swap" else 0
    if config.preemption_mode == "swap" and num_swap_blocks == 0:
        raise ConfigError(f"swap_space {config.swap_space} bytes holds no block of {bytes_per_block} bytes")
    num_offload_blocks = config.kv_offload_memory // bytes_per_block
    if config.kv_offload_memory and num_offload_blocks == 0:
        raise ConfigError(f"kv_offload_memory {config.kv_offload_memory} bytes holds no block of "
                          f"{bytes_per_block} bytes")
    disk_capacity_blocks = config.kv_offload_disk_bytes // bytes_per_block if config.kv_offload_dir else 0
    if config.kv_offload_dir and disk_capacity_blocks == 0:
        raise ConfigError(f"kv_offload_disk_bytes {config.kv_offload_disk_bytes} holds no block of "
                          f"{bytes_per_block} bytes")
    if tp is not None:
        num_offload_blocks = tp.min_int(num_offload_blocks)  # rank 0's host block ids address every rank's pool
    return PoolPlan(num_blocks, config.block_size, max_model_len, num_swap_blocks, bytes_per_block,
                    num_offload_blocks, disk_capacity_blocks)


def build_scheduler(config: EngineConfig, setup: ModelSetup, plan: PoolPlan, seq_ids) -> Scheduler:
    """The driver's Scheduler over the planned pool; `seq_ids` is the counter the engine numbers sequences with."""
    return Scheduler(
        SchedulerConfig(
            num_blocks=plan.num_blocks, block_size=config.block_size, max_model_len=plan.max_model_len,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            watermark=config.watermark, preemption_mode=config.preemption_mode,
            victim_policy=config.victim_policy, enable_chunked_prefill=config.enable_chunked_prefill,
            enable_prefix_caching=config.enable_prefix_caching, num_swap_blocks=plan.num_swap_blocks,
            num_offload_blocks=plan.num_offload_blocks, disk_capacity_blocks=plan.disk_capacity_blocks,
            max_in_step_restore_tokens=config.kv_offload_in_step_restore_tokens,
            kv_write_through=config.kv_offload_write_through,
            kv_layout=setup.kv_layout,
        ),
        eos_token_ids=setup.eos_token_ids,
        seq_ids=seq_ids,
    )


def build_runner(config: EngineConfig, setup: ModelSetup, plan: PoolPlan, device: torch.device, tp=None):
    """(KVPool, ModelRunner): the pool plus one scratch block, and the runner (capturing decode graphs)."""
    spec = setup.kv_spec
    layout = setup.kv_layout
    # One block more than the allocator hands out: CUDA-graph padding rows write their K/V there, and
    # sliding groups' tables hold it where blocks left the window (never read).
    pool = KVPool(spec.num_layers, plan.num_blocks + 1, config.block_size, spec.num_kv_heads, spec.head_dim,
                  setup.dtype, device, kv_cache_dtype=config.kv_cache_dtype, scales=setup.kv_scales,
                  layer_slots=layout.layer_slot if layout is not None else None)
    offload = None
    if plan.num_host_blocks:
        disk = shared = None
        if plan.disk_capacity_blocks:
            fields = disk_fingerprint_fields(config, setup, tp)
            if config.kv_offload_disk_writer == "process":
                from pagedkv.engine.kv_disk_process import ProcessDiskStore, SharedHostPool

                shared, why = SharedHostPool.create(plan.num_host_blocks * plan.bytes_per_block,
                                                    pin=device.type == "cuda")
                if shared is not None:
                    try:
                        disk = ProcessDiskStore(config.kv_offload_dir, fingerprint(fields), plan.bytes_per_block,
                                                shared)
                    except RuntimeError as error:
                        shared.close()
                        shared, why = None, str(error)
                if shared is None:
                    logger.warning("KV disk tier: writer threads, not a writer process: %s", why)
            if disk is None:
                disk = DiskStore(config.kv_offload_dir, fingerprint(fields), plan.bytes_per_block)
        offload = KVOffload(pool, plan.num_host_blocks, disk=disk, tp=tp, shared_host=shared)
    runner = ModelRunner(setup.model, pool, is_own_model=setup.model_impl == "pagedkv",
                         offload=offload, max_num_seqs=config.max_num_seqs,
                         max_num_batched_tokens=config.max_num_batched_tokens,
                         max_blocks_per_seq=num_blocks_for(plan.max_model_len, config.block_size),
                         num_table_rows=num_table_rows(config), max_model_len=plan.max_model_len,
                         vocab_size=setup.vocab_size, eos_token_ids=setup.eos_token_ids,
                         scratch_slot=plan.num_blocks * config.block_size, enforce_eager=config.enforce_eager,
                         mixed_step_graphs=config.mixed_step_graphs, tp=tp,
                         layer_groups=layout.layer_group if layout is not None else None)
    return pool, runner


def disk_fingerprint_fields(config: EngineConfig, setup: ModelSetup, tp=None) -> dict:
    """What decides the meaning of a KV block's bytes; the disk tier keys its files by their hash."""
    spec = setup.kv_spec
    scales = setup.kv_scales
    layout = setup.kv_layout
    # Layer groups: a block holds one group's layers, so the layout decides its bytes (absent: one table).
    groups = {} if layout is None else {"kv_layout": tuple(
        (group.attention_type, group.sliding_window, group.layer_indices, group.num_slots) for group in layout.groups)}
    return {
        "format": 1, "weights": weights_id(setup.model), "dtype": str(setup.dtype), "kv_dtype": str(setup.kv_dtype),
        "block_size": config.block_size, "kv_shape": (spec.num_layers, spec.num_kv_heads, spec.head_dim),
        "tp_rank": tp.rank if tp is not None else 0, "tp_size": config.tensor_parallel_size,
        "kv_scales": None if scales is None else hashlib.sha256(
            b"".join(t.float().cpu().numpy().tobytes() for t in (scales.k_scale, scales.v_scale))).hexdigest(),
        **groups,
    }


def weights_id(model: torch.nn.Module) -> str:
    """A hash of the model's parameter names, shapes and a sample of each one's values (its first 64)."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(f"{name}{tuple(param.shape)}{param.dtype}".encode())
        sample = param.detach().reshape(-1)[:64].float().cpu()
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def num_table_rows(config: EngineConfig) -> int:
    """Rows of the device block table: room for every running sequence and the next step's newcomers."""
    return 2 * config.max_num_seqs + 1


def _capacity_tokens(config: EngineConfig, layout: KVLayout | None, num_blocks: int) -> int:
    """The longest sequence `num_blocks` blocks hold (with layer groups: every group's blocks of it)."""
    if layout is None:
        return num_blocks * config.block_size
    low, high = 0, num_blocks * config.block_size * layout.num_groups  # sliding groups cap: far past the pool
    while low < high:  # the largest length whose peak blocks (decode or its longest chunk) fit
        mid = (low + high + 1) // 2
        need = layout.max_blocks_per_seq(mid, config.block_size, min(mid, config.max_num_batched_tokens))
        low, high = (mid, high) if need <= num_blocks else (low, mid - 1)
    return low


def log_pool(setup: ModelSetup, plan: PoolPlan) -> None:
    """One line: the pool's capacity and what it means for concurrency at max_model_len."""
    scales = setup.kv_scales
    kv_note = kv_cache_dtype_name(setup.kv_dtype) + (f", scales from {scales.source}" if scales else "")
    layout = setup.kv_layout
    per_seq = layout.max_blocks_per_seq(plan.max_model_len, plan.block_size) if layout is not None \
        else num_blocks_for(plan.max_model_len, plan.block_size)
    groups = f", {layout.num_groups} layer groups of {layout.num_slots} layers" if layout is not None else ""
    logger.info(
        "KV pool: %d blocks x %d tokens = %d tokens (%.1f MiB, KV dtype %s%s); max_model_len %d; "
        "max concurrency at max_model_len: %.2f", plan.num_blocks, plan.block_size, plan.capacity_tokens,
        plan.num_blocks * plan.bytes_per_block / 2**20, kv_note, groups, plan.max_model_len,
        plan.num_blocks / per_seq)


def _pick_model(config: EngineConfig, hf_model: torch.nn.Module, tp):
    """(model, "pagedkv" | "hf"): the own decoder where it covers the family (per `model_impl`), else HF's modules."""
    from pagedkv.models import build_own_model, is_supported

    wanted = config.model_impl
    hf_config = hf_model.config
    model_type = getattr(hf_config.get_text_config(), "model_type", None)
    if tp is not None and (wanted == "hf" or not is_supported(hf_config)):
        raise ConfigError(f"tensor parallelism runs on pagedkv's own decoder, which does not cover model_type "
                          f"{model_type!r} (or model_impl='hf' was asked for)")
    if wanted == "hf" or (wanted == "auto" and not is_supported(hf_config)):
        logger.info("model path: HF modules with pagedkv attention (model_type %r)", model_type)
        return hf_model, "hf"
    rotary_positions = config.max_model_len or max_positions(hf_config)
    own = build_own_model(hf_model, max_positions=rotary_positions, tp=tp)  # ConfigError if not covered
    logger.info("model path: pagedkv's own decoder (model_type %r)", model_type)
    return own, "pagedkv"


def _kv_scales(config: EngineConfig, hf_model: torch.nn.Module, tokenizer, kv_dtype: torch.dtype, tp,
               is_driver: bool):
    """This rank's FP8 scales: the checkpoint's, else calibrated on the built-in text (every rank alike)."""
    from pagedkv.hf.cache import kv_scales_for

    if tokenizer is None and not is_driver and config.model is not None:
        tokenizer = load_tokenizer(config.model)  # the same calibration tokens as rank 0
    scales = kv_scales_for(hf_model, kv_dtype, tokenizer=tokenizer)
    if tp is not None:
        scales = scales.shard(tp.rank, tp.size)
    return scales


def _num_blocks(config: EngineConfig, device: torch.device, bytes_per_block: int) -> int:
    if config.num_blocks is not None:
        return config.num_blocks
    memory = config.kv_cache_memory
    if isinstance(memory, int):
        budget = memory
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * (memory if memory is not None else 0.5))
    else:
        budget = int(2**30 * memory) if memory is not None else CPU_DEFAULT_KV_BYTES
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ConfigError(f"kv_cache_memory of {budget} bytes holds no block ({bytes_per_block} bytes per block)")
    return num_blocks


def _max_model_len(config: EngineConfig, hf_config, capacity_tokens: int) -> int:
    model_limit = max_positions(hf_config)
    wanted = config.max_model_len
    if wanted is not None:
        if model_limit and wanted > model_limit:
            raise ConfigError(f"max_model_len {wanted} exceeds the model's limit of {model_limit} positions")
        if wanted > capacity_tokens:
            raise ConfigError(
                f"max_model_len {wanted} does not fit: the KV pool holds {capacity_tokens} tokens, so the "
                f"largest model length that fits is {capacity_tokens} (raise kv_cache_memory or lower "
                f"max_model_len)"
            )
        return wanted
    return min(model_limit or capacity_tokens, capacity_tokens)
