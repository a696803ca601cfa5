"""Shards (`--shard I/N`, runs.parts) and `merge`: N shards together run exactly the unsharded
run's cases, and merge refuses what does not belong together. The CI examples' commands are run
in tests/test_ci_examples.py."""

import json
import shutil

import pytest

from mla_verify.cli import main
from mla_verify.runs import durations
from mla_verify.runs.units import shard_units, units
from mla_verify.equivalence.cases.profiles import get_profile
from mla_verify.fuzz.campaign import first_cases
from mla_verify.runs.parts import Shard, share

OPS = ["concat_mla_q", "split_prefill_chunks", "convert_index"]


def verdicts(frame):
    """Each row's case and verdict, in a run-independent order (run ids and timings differ)."""
    keys = ["op", "impl", "path", "case_id", "source", "tensor", "gate_metric", "passed"]
    return sorted(map(tuple, frame[keys].astype(str).values.tolist()))


def test_a_shard_is_parsed_checked_and_split_into_the_parts_of_one_host():
    assert Shard.parse("2/5") == Shard(2, 5) and str(Shard(2, 5)) == "2/5" and Shard.parse(None).whole
    for bad in ("3/3", "-1/3", "1", "a/b", "1/0"):
        with pytest.raises(ValueError, match="I/N"):
            Shard.parse(bad)
    assert Shard(1, 3).slots(2) == [Shard(2, 6), Shard(3, 6)]
    # fuzz: slot k is seed S + k with its share of the examples, the first ones one larger
    assert [Shard(k, 3).campaign(10, 7) for k in range(3)] == [(10, 3), (11, 2), (12, 2)]
    assert Shard(2, 3).campaign(10, 2) == (12, 0) and share(10, 3) == [4, 3, 3]


@pytest.mark.parametrize("env, shard, source", [
    ({"MLA_VERIFY_SHARD_INDEX": "1", "MLA_VERIFY_SHARD_COUNT": "3"}, (1, 3), "MLA_VERIFY_SHARD_INDEX=1 of "),
    ({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "8"}, (5, 8), "SLURM_ARRAY_TASK_ID=5 of "),
    ({"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "1",
      "SLURM_ARRAY_TASK_STEP": "2"}, (3, 4), "SLURM_ARRAY_TASK_ID=7"),          # --array=1-7:2
    ({"JOB_COMPLETION_INDEX": "0", "MLA_VERIFY_SHARD_COUNT": "2"}, (0, 2), "JOB_COMPLETION_INDEX=0 of "),
    ({"BUILDKITE_PARALLEL_JOB": "2", "BUILDKITE_PARALLEL_JOB_COUNT": "3"}, (2, 3), "BUILDKITE_PARALLEL_JOB=2"),
    ({"CI_NODE_INDEX": "1", "CI_NODE_TOTAL": "2"}, (0, 2), "CI_NODE_INDEX=1"),   # GitLab counts from 1
])
def test_shard_auto_reads_the_schedulers_own_index_and_count(monkeypatch, env, shard, source):
    for name in ("MLA_VERIFY_SHARD_INDEX", "MLA_VERIFY_SHARD_COUNT", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT",
                 "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_STEP", "JOB_COMPLETION_INDEX", "BUILDKITE_PARALLEL_JOB",
                 "BUILDKITE_PARALLEL_JOB_COUNT", "CI_NODE_INDEX", "CI_NODE_TOTAL", "CIRCLE_NODE_INDEX"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="no scheduler's shard index is set"):
        Shard.parse("auto")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parsed = Shard.parse("auto")
    assert (parsed.index, parsed.count) == shard and parsed.source.startswith(source) and parsed == Shard(*shard)
    monkeypatch.setenv(next(iter(env)), "9")
    with pytest.raises(ValueError, match="is not one of"):
        Shard.parse("auto")


def test_shards_sized_by_last_times_seconds_end_together_longest_first():
    units_ = ["a", "b", "c", "d", "e"]
    seconds = [100.0, 40.0, 30.0, 30.0, 5.0]
    by_time = [Shard(i, 2).deal(units_, weights=seconds) for i in range(2)]
    assert by_time == [["a", "e"], ["b", "c", "d"]]               # 105 s and 100 s
    assert [Shard(i, 2).deal(units_) for i in range(2)] == [["a", "c", "e"], ["b", "d"]]  # by count: 135 s and 70 s
    assert [Shard(i, 2).deal(units_, weights=[1.0] * 5) for i in range(2)] == [["a", "c", "e"], ["b", "d"]]
    assert Shard(0, 2).deal(units_, first=[False] * 4 + [True], weights=seconds) == ["b", "c", "d", "e"]  # e first


def test_the_gates_shards_are_disjoint_cover_every_unit_and_deal_multi_rank_ones_first():
    every = units(None, "cpu")
    dealt = [shard_units(None, "cpu", Shard(i, 4)) for i in range(4)]
    assert sorted(map(repr, sum(dealt, []))) == sorted(map(repr, every))
    assert all(u.multi_rank for u in every if u.op == "dcp") and any(u.op == "dcp" for u in dealt[0])
    for mine in dealt:  # each shard keeps the catalog's order
        assert [every.index(u) for u in mine] == sorted(every.index(u) for u in mine)


def test_three_fuzz_shards_merged_are_the_run_of_three_campaigns_case_for_case(capsys, tmp_path):
    from mla_verify import reports

    common = ["fuzz", "--op", "convert_index", "--examples", "7", "--seed", "11", "--device", "cpu",
              "--profile", "ci"]
    for i in range(3):
        assert main([*common, "--shard", f"{i}/3", "--out", str(tmp_path / f"shard-{i}")]) == 0
    text = capsys.readouterr().out
    cover = first_cases("convert_index", get_profile("ci"), None, None, (), "cpu", 12)  # runs whole, past its 2
    assert "shard 1/3 of 3 campaigns: seed 12 x 2" in text
    assert f"PASS: {max(2, len(cover))} examples, no discrepancy (seed 12)" in text
    assert main([*common, "--parallel", "3", "--out", str(tmp_path / "whole")]) == 0
    assert main(["merge", *(str(tmp_path / f"shard-{i}") for i in range(3)), "--out", str(tmp_path / "merged")]) == 0
    merged, meta = reports.load_run(tmp_path / "merged")
    whole, whole_meta = reports.load_run(tmp_path / "whole")
    assert verdicts(merged) == verdicts(whole) and len(merged)
    assert meta["seeds"] == whole_meta["seeds"] == [11, 12, 13] and meta["extra"]["examples"] == 7
    assert (tmp_path / "merged" / "report.html").exists()


@pytest.fixture(scope="module")
def gate_shards(tmp_path_factory):
    """Three CPU gate shards of OPS and the unsharded gate of the same seed."""
    root = tmp_path_factory.mktemp("gate")
    args = ["gate", "--device", "cpu", "--examples", "2", "--seed", "4", *(a for op in OPS for a in ("--op", op))]
    codes = [main([*args, "--shard", f"{i}/3", "--out", str(root / f"shard-{i}")]) for i in range(3)]
    codes.append(main([*args, "--out", str(root / "whole")]))
    assert codes == [0, 0, 0, 0]
    return root


def test_gate_shards_merged_are_the_unsharded_gate_case_for_case(capsys, gate_shards, tmp_path):
    from mla_verify import reports

    assert main(["merge", *(str(gate_shards / f"shard-{i}") for i in range(3)), "--out", str(tmp_path / "m")]) == 0
    assert "merged 3 of 3 shards" in capsys.readouterr().out
    merged, meta = reports.load_run(tmp_path / "m")
    assert verdicts(merged) == verdicts(reports.load_run(gate_shards / "whole")[0])
    assert "shard" not in meta["extra"] and len(meta["extra"]["merged"]) == 3
    # each shard's unit seconds, joined: what the next run's shards are sized by (gate --durations)
    seconds = durations.read(tmp_path / "m")
    assert sorted(seconds) == sorted(u.key for u in units(OPS, "cpu")) and all(s > 0 for s in seconds.values())
    assert seconds == {k: v for i in range(3) for k, v in durations.read(gate_shards / f"shard-{i}").items()}


def test_merge_refuses_missing_repeated_or_foreign_shards_and_names_each(capsys, gate_shards, tmp_path):
    shards = [str(gate_shards / f"shard-{i}") for i in range(3)]
    assert main(["merge", shards[0], shards[2], "--out", str(tmp_path / "a")]) == 2
    assert "missing shard(s) 1/3" in capsys.readouterr().err
    assert main(["merge", *shards, shards[1], "--out", str(tmp_path / "b")]) == 2
    assert "shard 1/3 given 2 times" in capsys.readouterr().err
    other = tmp_path / "other"
    shutil.copytree(shards[1], other)
    meta = json.loads((other / "meta.json").read_text())
    meta["git"]["revision"], meta["extra"]["run"]["seed"] = "0123abc", 5
    meta["extra"]["run"]["durations"] = "5ca1ab1e0000"   # dealt by other seconds: its units may overlap
    (other / "meta.json").write_text(json.dumps(meta))
    assert main(["merge", shards[0], str(other), shards[2], "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "ran revision 0123abc" in err and "seed 5 vs 4" in err and "durations '5ca1ab1e0000' vs None" in err
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())
    # told to, it merges what it has; cases that never ran are no pass
    assert main(["merge", shards[0], shards[2], "--out", str(tmp_path / "d"), "--force"]) == 1
    assert "MISSING shard(s) 1/3" in capsys.readouterr().out


def test_a_shard_with_nothing_to_run_is_a_usage_error(capsys, tmp_path):
    assert main(["fuzz", "--op", "convert_index", "--examples", "2", "--shard", "2/3", "--device", "cpu",
                 "--out", str(tmp_path / "f")]) == 2
    assert "leave it none" in capsys.readouterr().err
    assert main(["gate", "--device", "cpu", "--op", "split_prefill_chunks", "--shard", "1/2",
                 "--out", str(tmp_path / "g")]) == 2
    assert "fewer units" in capsys.readouterr().err
    assert main(["gate", "--device", "cpu", "--shard", "3/3"]) == 2


def test_a_failing_shard_fails_the_merge_and_its_saved_cases_come_along(capsys, tmp_path):
    args = ["fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.zoo.formats:divisor_224", "--examples", "20",
            "--seed", "5", "--device", "cpu", "--profile", "ci"]
    assert [main([*args, "--shard", f"{i}/2", "--out", str(tmp_path / f"s{i}")]) for i in range(2)] == [1, 1]
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "s0"), str(tmp_path / "s1"), "--out", str(tmp_path / "m")]) == 1
    from mla_verify.fuzz import casefile
    from mla_verify.runs.corpus import name

    # every finding comes along, once: two shards shrinking to one case are one finding, one file
    found = {name(casefile.load(p)) for i in range(2) for p in (tmp_path / f"s{i}" / "failures").glob("*.json")}
    merged = list((tmp_path / "m" / "failures").glob("*.json"))
    assert found and {name(casefile.load(p)) for p in merged} == found and len(merged) == len(found)
    assert f"FAIL: {len(found)} finding{'s' * (len(found) != 1)} in failures/: " in capsys.readouterr().out


def test_the_parts_of_a_shard_are_its_slots_and_travel_to_their_process_whole(tmp_path):
    from mla_verify.runs.plan import FuzzRun, GateRun, Run

    ci = dict(device="cpu", profile=get_profile("ci"), isolate=False, timeout=300.0)
    fuzz = FuzzRun(op="convert_index", examples=7, seed=11, shard=Shard(1, 2), parts=2, invocation="mla-verify fuzz ...",
                   **ci)
    assert fuzz.slots == [Shard(2, 4), Shard(3, 4)] and fuzz.campaigns == [(13, 2), (14, 1)]  # share(7, 4) = 2, 2, 2, 1
    part = fuzz.part(Shard(3, 4), 1, tmp_path)
    assert (part.seed, part.examples, part.shard, part.parts, part.out) == (14, 1, Shard(), 1, tmp_path / "part-1")
    again = Run.from_json(part.to_json())
    assert again.campaigns == [(14, 1)] and again.out.path == tmp_path / "part-1" and again.label == "torch-fp32"
    assert again.invocation == "mla-verify fuzz ..." and again.options() == part.options()
    again.out.release()
    gate = GateRun(ops=("convert_index",), examples=2, seed=4, shard=Shard(0, 3), parts=2, **ci)
    assert gate.part(gate.slots[1], 1, tmp_path).shard == Shard(1, 6) and gate.options()["ops"] == ["convert_index"]
