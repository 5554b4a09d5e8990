"""A recorded run with a cold tier (DESIGN.md §2.13, §5.3): its ``recalls`` rows are the window
occupants of every refill, the manifest says what the tier moved, and the value contract flags a
recall of a position never evicted and a step past the request (DESIGN.md §5.5)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tiny import tiny_model

import recorders
from h2o_lens import H2OConfig
from h2o_lens.cold_config import ColdTier
from recorders.replay import replay
from runlog import check_run, open_runs, read_manifest
from runlog.errors import ContractError

PROMPT, NEW = 30, 12


def _record(root, store="cpu"):
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    ids = torch.randint(3, 250, (2, PROMPT), generator=torch.Generator().manual_seed(4))
    cfg = H2OConfig(heavy=8, recent=3, cold=ColdTier(store=store, recall=3, select="pages", scan=1))
    with recorders.record(model, cfg, out=root, fsync=False) as run, torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return run.run_id


def _problems(root, run_id):
    con = open_runs(root, warn=False)
    reasons = [r for (r,) in con.execute("SELECT reason FROM problems WHERE run_id = ?", [run_id]).fetchall()]
    (integrity,) = con.execute("SELECT integrity FROM runs WHERE run_id = ?", [run_id]).fetchone()
    return reasons, integrity


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_the_recalls_round_trip_and_the_manifest_counts(tmp_path, store):
    run_id = _record(tmp_path, store)
    con = open_runs(tmp_path, warn=False)
    rec = con.execute(f"SELECT * FROM recalls WHERE run_id = '{run_id}' ORDER BY request, step, layer, kv_head").df()
    ev = con.execute(
        "SELECT request, layer, kv_head, position, min(step) AS gone FROM evictions WHERE run_id = ? GROUP BY ALL",
        [run_id],
    ).df()
    assert len(rec) and set(rec.tier) == {store}
    # every decode step of every request refills (every=1): 3 entries per layer and KV set once the store holds them
    per = rec.groupby(["request", "step", "layer", "kv_head"]).size()
    assert set(per) == {3} and sorted(set(rec.step)) == list(range(PROMPT, PROMPT + NEW - 1))
    merged = rec.merge(ev, on=["request", "layer", "kv_head", "position"], how="left")
    assert merged.gone.notna().all() and (merged.step > merged.gone).all()  # only what left, after it left
    assert (rec.bytes_read[rec.bytes_read > 0] == 2 * 16 * 4).all()  # K and V, d=16, float32
    # the policy's slots: 11 - 3; the steps table counts them, not the window
    assert set(con.execute(f"SELECT DISTINCT kept FROM steps WHERE run_id = '{run_id}'").fetchall()) == {(8,)}
    cold = read_manifest(tmp_path / run_id)["cold"]
    assert cold["store"] == store and cold["recall"] == 3 and cold["select"] == "pages"
    assert cold["recalled"] == int((rec.bytes_read > 0).sum()) and cold["bytes_read"] >= int(rec.bytes_read.sum())
    assert cold["bytes_written"] == cold["evicted"] * 2 * 16 * 4 and cold["evicted"] == len(
        con.execute(f"SELECT * FROM evictions WHERE run_id = '{run_id}'").fetchall()
    )
    assert _problems(tmp_path, run_id) == ([], "ok")
    view = con.execute("SELECT * FROM cold_runs WHERE run_id = ?", [run_id]).df().iloc[0]
    assert view.store == store and view.generated == 2 * NEW and view.bytes_read == cold["bytes_read"]
    assert view.bytes_read_per_token == cold["bytes_read"] / (2 * NEW) and np.isnan(view.recall_hit_rate)


def _rewrite(path, column, change):
    table = pq.read_table(path)
    i = table.schema.get_field_index(column)
    field = table.schema.field(i)
    values = change(table[column].to_numpy(zero_copy_only=False).copy())
    pq.write_table(table.set_column(i, field, pa.array(values, type=field.type)), path)


def _never_evicted(seg):
    # position PROMPT + NEW - 1 is the last token: no step evicts it before the run ends
    _rewrite(seg, "position", lambda v: np.where(np.arange(len(v)) == 0, PROMPT + NEW - 1, v))
    return "never evicted"


def _step_out_of_range(seg):
    _rewrite(seg, "step", lambda v: np.where(np.arange(len(v)) == 1, 10_000, v))
    return "has a recalls step of 10000"


@pytest.mark.parametrize("tamper", [_never_evicted, _step_out_of_range])
def test_a_recall_of_a_position_never_evicted_and_a_step_out_of_range_are_flagged(tmp_path, tamper):
    run_id = _record(tmp_path)
    (seg,) = sorted((tmp_path / run_id).glob("recalls-*.parquet"))
    said = tamper(seg)
    reasons, integrity = _problems(tmp_path, run_id)
    assert integrity != "ok" and any(said in r for r in reasons), reasons
    with pytest.raises(ContractError), pytest.warns(Warning):
        check_run(tmp_path / run_id)


def _replayed(root, recall, heavy):
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    ids = torch.randint(3, 250, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    cfg = H2OConfig(heavy=heavy, recent=3, cold=ColdTier(recall=recall))
    with recorders.record(model, cfg, out=root, fsync=False) as run, torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    summary = replay(root / run.run_id, model=model, progress=False)
    con = open_runs(root, warn=False)
    mass = con.execute("SELECT step, layer, q_head, dropped_mass FROM replay WHERE run_id = ?", [run.run_id]).df()
    return summary, mass


@pytest.mark.slow  # three recordings and their replays: about 16 s on 2 idle cores
def test_the_replay_counts_a_recalled_position_as_present_while_in_the_window(tmp_path):
    """The masked forward sees the window (the run's logits come back: the implementation check
    passes); a window that holds every evicted entry leaves no dropped mass, where the same
    policy's slots alone would drop some; a small window drops less than nothing recalled."""
    full, mass = _replayed(tmp_path / "a", recall=48, heavy=52)
    assert full.implementation_ok and full.mean_kl < 1e-6
    assert float(mass.dropped_mass.max()) < 1e-5
    (rate,) = open_runs(tmp_path / "a", warn=False).execute("SELECT recall_hit_rate FROM cold_runs").fetchone()
    assert rate > 0.9999  # the window held all of the teacher's attention to evicted positions
    small, small_mass = _replayed(tmp_path / "b", recall=3, heavy=7)
    assert small.implementation_ok and 0 < small.mean_dropped_mass
    (rate,) = open_runs(tmp_path / "b", warn=False).execute("SELECT recall_hit_rate FROM cold_runs").fetchone()
    assert 0 < rate < 1
    plain_root = tmp_path / "c"
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    ids = torch.randint(3, 250, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    with recorders.record(model, H2OConfig(heavy=4, recent=3), out=plain_root, fsync=False) as run, torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    plain = replay(plain_root / run.run_id, model=model, progress=False)
    assert plain.implementation_ok and plain.mean_dropped_mass > small.mean_dropped_mass


def test_the_footprint_counts_the_recall_window_as_held(tmp_path):
    """The window's slots are inside B (DESIGN.md §2.13): a run with a cold tier holds B slots per
    set after its last step, the window's recalled entries included, as plain H2O at the same B."""
    from analyses.curves import kv_footprint

    run_id = _record(tmp_path)
    got = kv_footprint(open_runs(tmp_path, warn=False), run_id).df()
    sets = 2 * 2  # layers × KV heads
    positions = PROMPT + NEW - 1  # the last token is never fed
    assert got.positions.tolist() == [positions, positions]
    assert got.kept_share.tolist() == pytest.approx([11 / positions] * 2)  # B = heavy 8 + recent 3
    assert (got.pages_held * 16 >= got.kept_share * positions * sets).all()
