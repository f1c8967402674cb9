"""How `mlxd jobs` draws jobs (mlxd/cli/admin/lab_cmds.py): a failed job says why in its row."""

from __future__ import annotations

from mlxd.cli.admin.lab_cmds import jobs_text


def job(state: str, **extra: object) -> dict[str, object]:
    return {"id": f"job_{state}", "kind": "finetune", "state": state, "created_at": 0.0,
            "progress": {"stage": "checking", "message": "3 train rows"}, **extra}


def test_a_failed_job_shows_its_error_and_a_running_one_its_progress() -> None:
    text = jobs_text({"data": [job("failed", error="valid.jsonl has 1 rows, fewer than batch_size 2"),
                               job("running", progress={"stage": "training", "step": 5, "total": 10}),
                               job("failed", error="x" * 300)]})
    lines = text.splitlines()
    assert "valid.jsonl has 1 rows, fewer than batch_size 2" in lines[1] and "checking" not in lines[1]
    assert "training · step 5/10" in lines[2]
    assert "x" * 99 + "…" in lines[3] and "x" * 100 not in lines[3]
    assert jobs_text({"data": []}).startswith("no jobs yet")
