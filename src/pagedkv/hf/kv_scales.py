"""Where an FP8 pool's scales come from: the checkpoint, or one calibration pass at startup.

`pagedkv.hf.cache.kv_scales_for(model, dtype)` returns a `KVScales` (`[num_layers, num_kv_heads]`
for K and V); this module reads the checkpoint's and holds the calibration text, and the
calibration pass itself runs in `pagedkv.hf.cache` (it needs a `PagedCache`):

1. From the checkpoint, where it has them. vLLM-style and compressed-tensors FP8 checkpoints
   carry K/V scales per attention layer: `self_attn.k_scale` / `self_attn.v_scale` (or one
   `self_attn.kv_scale` for both), or `self_attn.k_proj.output_scale` / `v_proj.output_scale`.
   A scalar applies to every KV head, a `[num_kv_heads]` vector per head. They are looked up
   as attributes of the loaded attention modules, then in the safetensors files of a local
   checkpoint directory (transformers drops tensors its modules do not declare).
2. Otherwise, by calibration: the model runs once over `CALIBRATION_TEXT` (fixed, built in)
   through a model-dtype `PagedCache`; each layer's per-KV-head absolute maximum of K (after
   rotary, as stored) and V, read back from the pages it wrote, maps to FP8_MAX / headroom.

Why a fixed text rather than the first prefill (vLLM's dynamic scales): the scales are then a
function of the model alone, identical on every run, rank and replica whatever request comes
first, and fixed before any request is served, so a block's bytes never need re-quantizing
and a preempted sequence recomputed later writes exactly the bytes it wrote before. K/V
magnitudes depend on the model far more than on the text; the 2x headroom covers the rest,
and anything past it saturates at the format's max instead of overflowing.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from pagedkv.errors import ConfigError
from pagedkv.kernels.fp8 import KVScales
from pagedkv.models.config import kv_shape_of

logger = logging.getLogger("pagedkv")

#: The calibration text: plain English prose of a few hundred tokens, not drawn from any benchmark text.
CALIBRATION_TEXT = (
    "The river rises in the hills to the north of the town, where the snow lies late into the spring, "
    "and it reaches the sea some forty miles to the south. For most of its length it is slow and wide, "
    "and in the summer children swim in the shallow pools below the old stone bridge. The bridge was built "
    "in the twelfth century by the monks of the abbey, who charged a small toll for every cart that crossed "
    "it; the money paid for the upkeep of the road and, it is said, for a good deal of wine. When the abbey "
    "was closed the bridge passed to the town council, which still repairs it every few years.\n\n"
    "A visitor who arrives by train will find the station a short walk from the market square. On Saturday "
    "mornings the square is crowded with stalls selling bread, cheese, fruit, fish and flowers, and the cafes "
    "along its eastern side put their tables out on the pavement. The library, a handsome building with tall "
    "windows, stands on the western side. It holds about sixty thousand books, a collection of old maps of "
    "the county, and the letters of a local poet who wrote about the river for most of his long life.\n\n"
    "How should one spend a day here? Start early, before the heat, with a walk along the towpath to the "
    "lock. Then climb the hill behind the church: from the top you can see the whole valley, the patchwork "
    "of fields, the line of the railway, and on a clear day the grey edge of the sea. In the afternoon the "
    "museum is worth an hour. Its rooms explain how the mills worked, why the town grew so quickly in the "
    "nineteenth century, and what happened when the mills closed. Finish with dinner by the water, where "
    "the evening light turns the stone of the bridge the colour of honey. Prices are reasonable, the fish is "
    "fresh, and nobody will hurry you out of your chair."
)
#: Tokens of the calibration pass at most (shorter where the model's context is shorter).
MAX_CALIBRATION_TOKENS = 512

_SCALE_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|attn|attention)\."
                        r"(k_scale|v_scale|kv_scale|k_proj\.output_scale|v_proj\.output_scale)$")


def calibration_token_ids(tokenizer, vocab_size: int, max_tokens: int = MAX_CALIBRATION_TOKENS) -> list[int]:
    """`CALIBRATION_TEXT` as token ids; without a tokenizer, its UTF-8 bytes as ids from 3 up (random models)."""
    if tokenizer is not None:
        ids = list(tokenizer(CALIBRATION_TEXT)["input_ids"])
    else:
        ids = [3 + byte % (vocab_size - 3) for byte in CALIBRATION_TEXT.encode("utf-8")]
    return ids[:max_tokens]


def _as_head_vector(value, num_kv_heads: int, where: str) -> torch.Tensor:
    """A checkpoint scale (scalar or per head) as `[num_kv_heads]` float32."""
    tensor = torch.as_tensor(value.detach() if isinstance(value, torch.Tensor) else value).float().cpu().reshape(-1)
    if tensor.numel() == 1:
        return tensor.expand(num_kv_heads).clone()
    if tensor.numel() == num_kv_heads:
        return tensor.clone()
    raise ConfigError(f"{where} has {tensor.numel()} values; expected 1 or num_kv_heads = {num_kv_heads}")


def _collect(found: dict[int, dict[str, object]], num_layers: int, num_kv_heads: int,
             source: str) -> KVScales | None:
    """Scales of every layer from {layer: {name: value}}, or None when none were found; partial sets raise."""
    if not found:
        return None
    k_rows, v_rows = [], []
    for layer in range(num_layers):
        names = found.get(layer, {})
        k = names.get("k_scale", names.get("k_proj.output_scale", names.get("kv_scale")))
        v = names.get("v_scale", names.get("v_proj.output_scale", names.get("kv_scale")))
        if k is None or v is None:
            raise ConfigError(f"{source} has K/V scales for some layers but not layer {layer} "
                              f"({sorted(found)[:8]}...): cannot serve FP8 with half a set")
        k_rows.append(_as_head_vector(k, num_kv_heads, f"{source} layer {layer} k scale"))
        v_rows.append(_as_head_vector(v, num_kv_heads, f"{source} layer {layer} v scale"))
    return KVScales(torch.stack(k_rows), torch.stack(v_rows), source)


def checkpoint_kv_scales(model: torch.nn.Module, checkpoint_dir: str | Path | None = None) -> KVScales | None:
    """K/V scales the checkpoint provides (see the module docstring), or None if it has none."""
    num_layers, num_kv_heads, _ = kv_shape_of(model.config)
    found: dict[int, dict[str, object]] = {}
    for name, module in model.named_modules():
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int) or not name.endswith(("self_attn", "attn", "attention")):
            continue
        for attr in ("k_scale", "v_scale", "kv_scale"):
            if getattr(module, attr, None) is not None:
                found.setdefault(layer, {})[attr] = getattr(module, attr)
        for proj in ("k_proj", "v_proj"):
            scale = getattr(getattr(module, proj, None), "output_scale", None)
            if scale is not None:
                found.setdefault(layer, {})[f"{proj}.output_scale"] = scale
    scales = _collect(found, num_layers, num_kv_heads, "checkpoint (attention modules)")
    if scales is not None or checkpoint_dir is None or not Path(checkpoint_dir).is_dir():
        return scales
    from safetensors import safe_open

    for path in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                match = _SCALE_KEY.search(key)
                if match:
                    found.setdefault(int(match.group(1)), {})[match.group(2)] = handle.get_tensor(key)
    return _collect(found, num_layers, num_kv_heads, f"checkpoint ({checkpoint_dir})")
