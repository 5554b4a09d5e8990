"""Decode steps replayed from captured graphs (DESIGN.md §2.16): the traced rehearsal on CPU and,
where a CUDA device is present, CUDA graphs, against the eager path: same tokens, same cache
state, same log; every other forward runs eagerly with its reason."""

from __future__ import annotations

import json

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from tiny import left_padded, tiny_model

from h2o_lens import H2OConfig, compat, h2o
from h2o_lens.cold_config import ColdTier
from h2o_lens.errors import ConfigError
from h2o_lens.graphs import WARMUP, GraphCaptureError, GraphedForward, TracedGraph
from h2o_lens.timing import Decoder
from recorders import record

CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", id="traced"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.kernel, pytest.mark.skipif(not CUDA, reason="no CUDA")]),
]


def _layers_state(cache) -> list[tuple[torch.Tensor, ...]]:
    return [(lay.keys.clone(), lay.values.clone(), lay.scores.clone(), lay.positions.clone()) for lay in cache.layers]


# -- the traced graph itself -------------------------------------------------------------------------


def test_traced_graph_replays_on_its_buffers_and_freezes_host_values():
    x = torch.arange(4.0)
    acc = torch.zeros(4)
    host = {"n": 2}

    def step():
        acc.add_(x * host["n"])  # a buffer updated in place, a host value read once
        return acc.sum()

    graph = TracedGraph()
    total = graph.capture(step)
    assert torch.equal(acc, torch.tensor([0.0, 2, 4, 6])) and total.item() == 12
    x.copy_(torch.ones(4))  # new input in the same buffer
    host["n"] = 100  # a host value the capture read: frozen, as in a CUDA graph
    graph.replay()
    assert torch.equal(acc, torch.tensor([2.0, 4, 6, 8]))
    assert total.item() == 20  # the captured output buffer holds the replay's result


@pytest.mark.parametrize("read", ["item", "bool", "nonzero"])
def test_traced_capture_refuses_host_reads(read):
    x = torch.arange(5.0)
    reads = {"item": lambda: x.sum().item(), "bool": lambda: bool((x > 2).any()), "nonzero": lambda: x.nonzero()}
    with pytest.raises(GraphCaptureError, match="host"):
        TracedGraph().capture(reads[read])


def test_graphs_argument_is_checked():
    model = tiny_model()
    with pytest.raises(ConfigError, match="graphs must be"):
        with h2o(model, H2OConfig(heavy=4, recent=4), graphs="yes"):
            pass


# -- generate under graphs ----------------------------------------------------------------------------


def _generate(model, config, ids, mask, graphs, new=16, **extra):
    with h2o(model, config, graphs=graphs) as session:
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
            **extra,
        )
        return out, _layers_state(session.last_cache), session.graphs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "family, dtype, policy",
    [("llama", torch.float32, "h2o"), ("qwen2", torch.bfloat16, "h2o"), ("llama", torch.float32, "tova")],
)
def test_generate_under_graphs_equals_eager(device, family, dtype, policy):
    model = tiny_model(family).to(device=device, dtype=dtype)
    ids, mask = left_padded([40, 27, 33], seed=3)
    ids, mask = ids.to(device), mask.to(device)
    backend = "torch" if device == "cpu" else "triton"  # on a GPU the fused step, captured with the rest
    config = H2OConfig(policy=policy, heavy=6, recent=6, backend=backend)
    eager, eager_state, off = _generate(model, config, ids, mask, graphs=False)
    graphed, graphed_state, graphs = _generate(model, config, ids, mask, graphs=True)
    assert off is None
    assert graphs.kind == ("cuda" if device == "cuda" else "traced")
    assert graphs.captures == 1 and graphs.replayed == 16 - 1 - WARMUP  # the prefill makes the first token
    assert torch.equal(eager.sequences, graphed.sequences)
    for a, b in zip(eager.scores, graphed.scores):
        assert torch.equal(a, b)  # the logits, bit for bit
    for a, b in zip(eager_state, graphed_state):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_filling_cache_runs_eagerly_until_full_then_replays():
    model = tiny_model()
    ids = torch.randint(5, 200, (1, 6), generator=torch.Generator().manual_seed(1))
    config = H2OConfig(heavy=6, recent=6, backend="torch")  # 12 slots, a 6-token prompt
    eager, eager_state, _ = _generate(model, config, ids, None, graphs=False, new=20)
    graphed, graphed_state, graphs = _generate(model, config, ids, None, graphs=True, new=20)
    filling = graphs.fallbacks["the cache is still filling its slots (shapes change until every slot is used)"]
    assert filling == 12 - 6  # the steps that fill the last slots
    assert graphs.replayed == 19 - filling - WARMUP
    assert torch.equal(eager.sequences, graphed.sequences)
    for a, b in zip(eager_state, graphed_state):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_tiered_cache_and_beam_search_fall_back_or_capture_again():
    model = tiny_model()
    ids, mask = left_padded([30, 30], seed=4)
    cold = H2OConfig(heavy=6, recent=6, backend="torch", cold=ColdTier(store="cpu", recall=2))
    eager, _, _ = _generate(model, cold, ids, mask, graphs=False, new=8)
    graphed, _, graphs = _generate(model, cold, ids, mask, graphs=True, new=8)
    assert graphs.replayed == 0 and graphs.captures == 0
    assert any("ColdExtension" in reason for reason in graphs.fallbacks)
    assert torch.equal(eager.sequences, graphed.sequences)
    # beam search moves the rows every step (new buffers): each step is captured again
    plain = H2OConfig(heavy=6, recent=6, backend="torch")
    eager, _, _ = _generate(model, plain, ids, mask, graphs=False, new=8, num_beams=2)
    graphed, _, graphs = _generate(model, plain, ids, mask, graphs=True, new=8, num_beams=2)
    assert graphs.captures >= 2
    assert torch.equal(eager.sequences, graphed.sequences)


def test_static_cache_under_graphs_equals_eager():
    from transformers import StaticCache

    model = tiny_model()
    ids = torch.randint(5, 200, (2, 30), generator=torch.Generator().manual_seed(2))
    logits = {}
    for graphs in (None, "traced"):
        dec = Decoder(model, StaticCache(config=model.config, max_cache_len=64), ids, graphs=graphs)
        seen = []
        for _ in range(12):
            with torch.no_grad():
                out = dec.forward(input_ids=dec.token, **compat.cache_kwargs(dec.cache), use_cache=True)
            dec.token = out.logits[:, -1:].argmax(-1)
            seen.append(out.logits)
        logits[graphs] = torch.cat(seen, 1)
        if graphs:
            assert isinstance(dec.forward, GraphedForward) and dec.forward.replayed == 12 - WARMUP
    assert torch.equal(logits[None], logits["traced"])


# -- a recording under graphs -------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_a_recording_under_graphs_writes_the_same_log(tmp_path, device):
    pytest.importorskip("duckdb")  # the recorder's log reader (a GPU machine may lack it)
    model = tiny_model().to(device)
    ids, mask = (t.to(device) for t in left_padded([40, 27], seed=1))
    config = H2OConfig(heavy=8, recent=8, backend="torch" if device == "cpu" else "triton")
    for graphs in (False, True):
        with record(model, config, out=str(tmp_path), run_id=f"g{int(graphs)}", graphs=graphs, flush_every=4):
            gen = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
            model.generate(input_ids=ids, attention_mask=mask, **gen)
    manifest = json.loads((tmp_path / "g1" / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    kind = "traced" if device == "cpu" else "cuda"
    assert manifest["graphs"]["kind"] == kind and manifest["graphs"]["replayed"] == 23 - WARMUP
    assert "graphs" not in json.loads((tmp_path / "g0" / "manifest.json").read_text())
    for table in ("evictions", "steps", "tokens", "run_logits", "requests"):
        a, b = (_table(tmp_path / f"g{g}", table) for g in (0, 1))
        assert len(a) > 0 and a.equals(b), table
    assert (_table(tmp_path / "g1", "evictions")["phase"] == "decode").sum() > 0


def _table(run_dir, name: str) -> pd.DataFrame:
    """A run's table, every segment, rows in one order, without the run's id."""
    parts = [pq.read_table(f).to_pandas() for f in sorted(run_dir.glob(f"{name}-*.parquet"))]
    frame = pd.concat(parts).drop(columns=["run_id"])
    return frame.sort_values(list(frame.columns)).reset_index(drop=True)


def test_a_press_recording_refuses_graphs(tmp_path):
    from recorders.recorder import RecorderError

    pytest.importorskip("kvpress")
    from kvpress import SnapKVPress

    with pytest.raises(RecorderError, match="without graphs"):
        with record(tiny_model(), SnapKVPress(compression_ratio=0.5), out=str(tmp_path), graphs=True):
            pass


# -- the end-to-end benchmark's graph rows --------------------------------------------------------------


def test_end_to_end_bench_times_graph_captured_paths(capsys):
    from h2o_lens.kernels.bench import bench_end_to_end

    shape = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    out = bench_end_to_end(
        context=48, batch=2, steps=4, rounds=1, device="cpu", dtype=torch.float32, shape=shape,
        backends=("torch",), graphs=True,
    )  # fmt: skip
    assert out["full graphs ÷ graphed full"] == 1.0
    assert out["full graphs replayed"] > 0 and out["h2o torch graphs replayed"] > 0
    assert out["h2o torch graphs KV bytes"] == out["h2o torch KV bytes"] < out["full graphs KV bytes"]
    assert "÷ graphed full" in capsys.readouterr().out


def test_max_batch_bench_turns_the_memory_saved_into_batch(capsys):
    from h2o_lens.kernels.bench_batch import bench_max_batch

    shape = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256,
    )  # fmt: skip
    memory, headroom = 8 << 20, 1 << 20
    out = bench_max_batch(
        shape=shape, context=200, keep=0.2, steps=3, rounds=1, device="cpu", dtype=torch.float32,
        backend="torch", memory=memory, headroom=headroom,
    )  # fmt: skip
    full, ours = out["full"], out["h2o"]
    # a full row holds every position (2 layers x 2 KV heads x 16 dims x K and V, float32), H2O 20 % of them
    positions = 200 + (1 + 2) * 3 + 8
    logits = 2 * 256 * 4
    assert full["bytes_per_row"] == 2 * 2 * 2 * 16 * 4 * positions + logits
    assert full["batch"] == (memory - headroom) // full["bytes_per_row"]
    assert ours["batch"] == (memory - headroom) // ours["bytes_per_row"] > 3 * full["batch"]
    for res in (full, ours):
        assert res["eager"] > 0 and res["graphs"] > 0
    assert "max batch at 200 tokens" in capsys.readouterr().out


def test_bench_kernels_options_are_checked():
    import subprocess
    import sys

    for bad in (["--cases", "8x0"], ["--cases", "eight"], ["--max-batch", "1"]):
        res = subprocess.run(
            [sys.executable, "-m", "commands.cli", "bench", "kernels", *bad], capture_output=True, text=True
        )
        assert res.returncode != 0 and "h2o-lens: error:" in res.stderr, (bad, res.stderr)


@pytest.mark.parametrize(
    "extra", [["--task", "delayed_recall_0"], ["--teacher-force", "run-x"], ["--policy", "full", "--prompt", "hi"]]
)
def test_record_refuses_graphs_where_nothing_is_replayed(extra, tmp_path):
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "commands.cli", "record", "--graphs", "--out", str(tmp_path), *extra],
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0 and "h2o-lens: error: --graphs cannot be combined" in res.stderr, res.stderr
    assert not any(tmp_path.iterdir())  # refused before anything is written
