"""``h2o-lens bench decode``: runs end to end on a tiny model and prints its columns (no timing asserted)."""

from __future__ import annotations

import re

import pytest
from test_commands_sweep_grid import _byte_tokenizer
from tiny import tiny_model

from commands.benchmarks.decode import bench_decode
from commands.cli import main

COLUMNS = (
    "batch",
    "full ms/step",
    "full tok/s",
    "h2o ms/step",
    "h2o tok/s",
    "h2o/full tok/s",
    "limit ms/step",
    "h2o/limit",
    "KV h2o/full",
)
PARTS = re.compile(
    r"H2O's step \(ms\): attention ([\d.]+), scores ([\d.]+), victim ([\d.]+), copy ([\d.]+) \(timed apart\), "
    r"other \(the model's projections and MLP, hooks, bookkeeping\) (-?[\d.]+); in the model its attention and "
    r"eviction take (-?[\d.]+) \(the step less the step with them frozen\)"
)


def _rows(out: str, context: int) -> dict[int, list[float]]:
    """The table of ``context``: batch size -> the numbers of its row."""
    block = out.split(f"context {context}, H2O B=")[1].split("prefill")[0]
    rows = {}
    for line in block.splitlines()[2:]:
        nums = line.split()
        if nums and nums[0].isdigit():  # a batch's row, then the line of where its H2O step goes
            rows[int(nums[0])] = [float(x) for x in nums[1:]]
    return rows


def test_bench_decode_prints_a_table_per_context_with_a_row_per_batch(capsys):
    model = tiny_model("llama", layers=2)
    assert bench_decode(model=model, contexts=(40, 64), batches=(1, 3), steps=2, rounds=1) == 0
    out = capsys.readouterr().out
    for n in (40, 64):
        header = out.split(f"context {n}, H2O B=")[1].splitlines()[1]
        assert all(c in header for c in COLUMNS), header
        rows = _rows(out, n)
        assert sorted(rows) == [1, 3]
        for b, (full_ms, full_tps, h2o_ms, h2o_tps, ratio, limit_ms, of_limit, kv_mib, kv_share) in rows.items():
            assert full_ms > 0 and h2o_ms > 0 and limit_ms > 0
            assert full_tps == pytest.approx(b * 1e3 / full_ms, rel=0.02)
            assert h2o_tps == pytest.approx(b * 1e3 / h2o_ms, rel=0.02)
            assert ratio == pytest.approx(h2o_tps / full_tps, rel=0.05)
            assert of_limit == pytest.approx(h2o_ms / limit_ms, rel=0.05)
            assert 0 < kv_share < 0.5 and kv_mib > 0  # 20 % of the context, plus scores and positions
        parts = [PARTS.search(line) for line in out.split(f"context {n}, H2O B=")[1].split("prefill")[0].splitlines()]
        parts = [m for m in parts if m]
        assert len(parts) == 2, out  # one per batch size
        for m in parts:
            attention, scores, victim, copy, _, _ = map(float, m.groups())
            assert min(attention, scores, victim, copy) >= 0 and attention > 0
        assert re.search(rf"prefill {n} tokens: SDPA \d+ ms, with scores \d+ ms: ratio [\d.]+", out)
        assert f"prefill {n} peak RSS: skipped" in out  # a model object cannot be loaded in a fresh process


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_tiny")
    tok = _byte_tokenizer()
    tiny_model("llama", vocab=len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.slow
def test_bench_decode_cli_measures_prefill_peak_rss_in_fresh_processes(tiny_dir, capsys):
    argv = ["bench", "decode", "--model", str(tiny_dir), "--contexts", "48", "--batch", "1", "2"]
    assert main([*argv, "--steps", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert sorted(_rows(out, 48)) == [1, 2]
    m = re.search(
        r"prefill 48 peak RSS \(fresh processes\): SDPA ([\d.]+) GiB, with scores ([\d.]+) GiB: ratio ([\d.]+)", out
    )
    assert m, out
    sdpa, scores, ratio = map(float, m.groups())
    assert sdpa > 0 and scores > 0 and ratio == pytest.approx(scores / sdpa, rel=0.1)


@pytest.mark.parametrize("flag", [["--batch", "0"], ["--contexts", "1"], ["--steps", "0"]])
def test_bench_decode_refuses_bad_sizes(flag, capsys):
    assert main(["bench", "decode", "--model", "unused", *flag]) == 2
    err = capsys.readouterr().err
    assert err.startswith("h2o-lens: error: bench decode: argument " + flag[0]) and err.count("\n") == 1, err


@pytest.mark.parametrize("flag", [["--keep", "-1"], ["--keep", "1.5"], ["--rounds", "0"], ["--new-tokens", "1"]])
def test_bench_assistant_refuses_bad_input_before_loading_a_model(flag, capsys):
    code = None
    try:
        code = main(["bench", "decode", "--assistant", "--model", "unused", *flag])
    except SystemExit as exc:  # a check of the assistant bench's own
        assert flag[0] in str(exc.code)
        return
    assert code == 2 and flag[0] in capsys.readouterr().err


@pytest.mark.slow
def test_bench_assistant_prints_both_speed_ups_and_the_acceptance(capsys):
    """``bench decode --assistant`` on a tiny model: four ways, the forwards each speculative way
    needed, whether H2O's tokens are the full cache's, and the ratio (no timing asserted)."""
    from commands.benchmarks.decode import bench_assistant

    tok = _byte_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    model = tiny_model("llama", layers=2, vocab=len(tok))
    model.generation_config.eos_token_id = None
    new = 20
    assert bench_assistant(model=model, tokenizer=tok, new_tokens=new, rounds=1, keep=0.5, lookup_tokens=4) == 0
    out = capsys.readouterr().out
    for name in ("full cache", "H2O"):
        line = next(x for x in out.splitlines() if x.strip().startswith(f"{name}:"))
        m = re.search(r"speed-up ([\d.]+)x, same tokens: yes; (\d+) verification forwards, ([\d.]+) tokens each", line)
        assert m, line
        forwards, per = int(m.group(2)), float(m.group(3))
        assert 1 < forwards <= new and per == pytest.approx((new - 1) / (forwards - 1), abs=0.01)
    assert re.search(r"H2O's tokens (are the full cache's|differ from the full cache's from new token \d+)", out)
    assert re.search(r"H2O keeps [\d.]+ of the full cache's speed-up \(target >= 0.90\)", out)


def test_bench_decode_with_a_cold_tier_times_it_and_says_the_bytes_it_read(capsys):
    """``--cold``: the H2O side runs with a recall window inside B (its config line says so) and
    each row says the cold bytes read per decode step, which a window reads."""
    from h2o_lens.cold_config import parse_cold

    model = tiny_model("llama", layers=2)
    assert bench_decode(model=model, contexts=(64,), batches=(1, 2), steps=2, rounds=2, cold=parse_cold("cpu:3")) == 0
    out = capsys.readouterr().out
    assert "cold=cpu:3:exact" in out.split("context 64, H2O B=")[1].splitlines()[0]
    assert sorted(_rows(out, 64)) == [1, 2]
    read = [int(m.replace(",", "")) for m in re.findall(r"cold tier: ([\d,]+) bytes read per step", out)]
    assert len(read) == 2 and all(r > 0 for r in read)
    # H2O at the same B without the tier is timed beside it, and the ratio is the two times'
    side = re.findall(r"without it ([\d.]+) ms/step: with ÷ without ([\d.]+) \(per round ([\d.]+)–([\d.]+)", out)
    assert len(side) == 2 and all(float(t) > 0 and float(x) > 0 for t, x, *_ in side)
    # and the spread of the two rounds' ratios, which holds their median
    assert all(0 < float(lo) <= float(x) <= float(hi) for _, x, lo, hi in side)


def test_frozen_steps_compute_each_layers_step_once_and_put_the_step_back():
    """Inside ``frozen_steps`` a cache's decode steps return their first result without being
    computed again (the model runs every thing else); outside, the real step is back and a fresh
    cache decodes the same tokens as before."""
    import torch

    from h2o_lens import ops
    from h2o_lens.config import H2OConfig
    from h2o_lens.runtime import h2o
    from h2o_lens.timing import Decoder, frozen_steps

    model = tiny_model("llama", layers=2)
    ctx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    real, calls = ops.decode_step, []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    with h2o(model, H2OConfig(heavy=4, recent=4)) as session:
        plain = Decoder(model, session.new_cache(), ctx)
        plain.run(4)
        frozen = Decoder(model, session.new_cache(), ctx)
        ops.decode_step = counting
        try:
            with frozen_steps():
                assert ops.decode_step is not counting
                frozen.run(4)
        finally:
            restored, ops.decode_step = ops.decode_step, real
        assert restored is counting and len(calls) == 2  # one real step per layer, then its result again
        kept = frozen.cache.layers[0].positions.clone()
        again = Decoder(model, session.new_cache(), ctx)
        again.run(4)
    assert torch.equal(again.token, plain.token)
    assert int(kept.max()) == 40  # the frozen cache holds the first step's token (position 40) and no later one


def test_bench_decode_on_the_cpp_backend_names_it_and_freezes_its_fused_step(capsys):
    """``backend="cpp"``: the table names the fused CPU step, the row's step is not split into the
    torch step's parts, and the in-model figure freezes the fused step (so it is measured)."""
    from h2o_lens.kernels.cpu import cpu_step_problem

    if cpu_step_problem() is not None:
        pytest.skip(cpu_step_problem())
    model = tiny_model("llama", layers=2)
    assert bench_decode(model=model, contexts=(48,), batches=(1, 2), steps=2, rounds=1, backend="cpp") == 0
    out = capsys.readouterr().out
    assert "backend cpp (the fused CPU step)" in out
    assert sorted(_rows(out, 48)) == [1, 2]
    found = re.findall(r"H2O's step \(ms\): in the model its fused attention and eviction take (-?[\d.]+)", out)
    assert len(found) == 2 and "timed apart" not in out


def test_frozen_steps_freeze_the_fused_cpu_step_too():
    import torch

    from h2o_lens import ops
    from h2o_lens.kernels import cpu
    from h2o_lens.timing import frozen_steps

    if cpu.cpu_step_problem() is not None:
        pytest.skip(cpu.cpu_step_problem())
    real = cpu.decode_step_cpu
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 1, 6, 8, generator=gen), torch.randn(1, 1, 6, 8, generator=gen)
    state = [keys, values, torch.zeros(1, 1, 6), torch.arange(6, dtype=torch.int32).view(1, 1, 6)]
    new = [torch.randn(1, 1, 8, generator=gen) for _ in range(3)]
    args = ops.PolicyArgs("h2o", 3, 3, 0, "sum")
    with frozen_steps():
        first = cpu.decode_step_cpu(*new, *state, torch.tensor([6]), None, 0.3, args)
        kept = state[3].clone()
        again = cpu.decode_step_cpu(*new, *state, torch.tensor([7]), None, 0.3, args)
    assert again is first and torch.equal(state[3], kept)  # the second call computed nothing
    assert cpu.decode_step_cpu is real
