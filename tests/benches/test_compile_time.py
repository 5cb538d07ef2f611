"""benches/compile_time.py: a step.py record split into the compile's phases, and its table."""

from __future__ import annotations

import json

from compile_time import breakdown, compile_threads, main, runs, table


def _record() -> dict:
    return {
        "warmup_s": 30.0,
        "compile_phases_s": {
            "bytecode_tracing": 4.0,
            "create_aot_dispatcher_function": 20.0,
            "invoke_subgraph_proxy_tensor": 1.5,
            "invoke_subgraph_trace_joint_graph": 0.5,
            "compile_fx.<locals>.fw_compiler_base": 6.0,
            "compile_fx.<locals>.bw_compiler": 5.0,
            "GraphLowering.codegen": 3.0,
            "GraphLowering.run": 2.5,
            "Scheduler.__init__": 0.75,
            "async_compile.wait": 1.25,
        },
        "zrs_compile_s": dict(
            lower=0.5,
            keep=0.1,
            buckets=0.1,
            coalesce=0.3,
            profile=2.0,
            plan=0.5,
            rank_check=0.2,
            budget=0.1,
            sweep=0.7,
        ),
        "first_step_gc_s": {"young_s": 0.4, "full_s": 1.5, "full_collections": 3},
        "step_ms_med": 101.5,
    }


def test_inductor_excludes_zrs_passes_and_aot_excludes_inductor() -> None:
    b = breakdown(_record())
    assert b["first_step"] == 30.0 and b["dynamo"] == 4.0
    assert b["aot"] == 9.0  # 20 - (6 + 5): the inductor compiles run inside AOTAutograd
    assert b["region_traces"] == 2.0
    assert b["inductor"] == 7.5  # 11 - the passes, profile and plan (3.5) that ran inside it
    assert (b["zrs_passes"], b["profile"], b["plan"], b["exchanges"]) == (1.0, 2.0, 0.5, 1.0)
    assert (b["codegen"], b["lowering"], b["scheduling"], b["triton"]) == (3.0, 2.5, 0.75, 1.25)
    assert b["gc_full"] == 1.5


def test_a_record_without_zrs_timers_is_torch_only() -> None:
    rec = _record()
    del rec["zrs_compile_s"]
    b = breakdown(rec)
    assert b["inductor"] == 11.0 and b["zrs_passes"] == b["exchanges"] == 0.0


def test_the_table_has_a_row_per_run_and_names_a_failed_one() -> None:
    row = {"system": "zrs", "preset": "1b", "world": 2, "cache": "cold"}
    ok = row | breakdown(_record()) | {"step_ms_med": 101.5}
    failed = row | {"cache": "warm", "error": "exit status 1"}
    lines = table([ok, failed]).splitlines()
    assert len(lines) == 4 and "| 30.0 |" in lines[2] and "exit status 1" in lines[3]


def test_the_table_gives_each_graphs_own_compile() -> None:
    row = {"system": "zrs_shard_compile", "preset": "1b", "world": 2, "cache": "cold"}
    graphs = [{"id": "0/0", "fw_s": 3.44, "bw_s": 1.2}, {"id": "1/0", "fw_s": 2.0}]
    rec = _record() | {"compile_graphs": graphs}
    lines = table([row | breakdown(rec) | {"record": rec}, row | breakdown(_record())])
    assert lines.splitlines()[2].endswith("| 3.4+1.2, 2.0+0.0 |"), lines
    assert lines.splitlines()[3].endswith("| - |"), lines


def test_compile_threads_are_torchs_split_among_the_ranks_or_given() -> None:
    assert compile_threads("torch", 2, 32) is None
    assert compile_threads("split", 2, 32) == "16"
    assert compile_threads("split", 64, 32) == "1"
    assert compile_threads("4", 2, 32) == "4"


def test_a_file_from_before_a_phase_shows_it_from_its_kept_record(tmp_path, capsys) -> None:
    row = {"system": "zrs", "preset": "1b", "world": 1, "cache": "cold", "first_step": 30.0}
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps(row | {"record": _record()}) + "\n")
    main(["--table", str(old)])
    head, _, cells = capsys.readouterr().out.splitlines()
    values = dict(zip(head.split(" | "), cells.split(" | "), strict=True))
    assert values["lowering"] == "2.5" and values["triton"] == "1.2"


def test_rounds_turn_the_systems_and_keep_each_warm_run_after_its_cold_one() -> None:
    order = runs(["a", "b", "c"], [1, 2], ["cold", "warm"], rounds=2)
    assert [(r, s) for r, s, w, st in order if w == 1 and st == "cold"] == [
        (0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"),
    ]  # fmt: skip
    assert order[:4] == [
        (0, "a", 1, "cold"),
        (0, "a", 1, "warm"),
        (0, "a", 2, "cold"),
        (0, "a", 2, "warm"),
    ]
