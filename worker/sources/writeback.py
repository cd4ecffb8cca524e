"""What a source writes back to its tracker, and how it never writes it twice.

Every write-back is kept under a key in the item's row (``fleet.source_posted``): the task's state
and the journal event that put it there (``done:<event id>``), so a retry, a second host or a re-run
of the same outcome finds it made. A comment also carries that key in an HTML comment (its
marker): a pass that crashed between posting and recording finds its own comment in the issue and
records it instead of posting again.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any


def marker(source: str, ref: str, key: str) -> str:
    return f"<!-- lanefleet source={source} item={ref} outcome={key} -->"


def _money(value: Any) -> str:
    return f"${Decimal(str(value or 0)):.4f}"


def _tokens(spend: dict[str, Any]) -> str:
    return (f"{int(spend.get('input_tokens') or 0):,} in, {int(spend.get('output_tokens') or 0):,} out, "
            f"{int(spend.get('cache_read_tokens') or 0):,} cache read, "
            f"{int(spend.get('cache_creation_tokens') or 0):,} cache write")


def _summary(result: Any) -> str | None:
    if isinstance(result, dict):
        for name in ("summary", "message", "result"):
            if isinstance(result.get(name), str) and result[name].strip():
                return str(result[name]).strip()
        return None
    return str(result).strip() if isinstance(result, str) and result.strip() else None


def done_comment(row: dict[str, Any]) -> str:
    spend = row.get("spend") or {}
    lines = [f"lanefleet finished task `{row['key']}` (lane {row['task_lane']}).", ""]
    if summary := _summary(row.get("result")):
        lines += ["> " + line for line in summary[:3000].splitlines()] + [""]
    if row.get("pr_url"):
        lines.append(f"- pull request: {row['pr_url']}")
    lines += [f"- runs: {int(spend.get('runs') or 0)}", f"- tokens: {_tokens(spend)}",
              f"- cost: {_money(spend.get('cost_usd'))}"]
    return "\n".join(lines)


def failure_comment(row: dict[str, Any]) -> str:
    spend = row.get("spend") or {}
    detail = (row.get("outcome") or {}).get("detail") or {}
    state = row["state"]
    reason = row.get("block_reason") if state == "blocked" else row.get("dead_reason")
    evidence = detail.get("evidence") or row.get("last_error") or ""
    what = "is blocked and needs a person" if state == "blocked" else "gave up on"
    lines = [f"lanefleet {what} task `{row['key']}` (lane {row['task_lane']}): "
             f"{reason or detail.get('reason') or state}.", ""]
    if evidence:
        lines += ["Evidence:", "", "```", str(evidence)[-3000:].replace("```", "ʼʼʼ"), "```", ""]
    if row.get("pr_url"):
        lines.append(f"- pull request: {row['pr_url']}")
    lines += [f"- runs: {int(spend.get('runs') or 0)}", f"- tokens: {_tokens(spend)}",
              f"- cost: {_money(spend.get('cost_usd'))}", "",
              f"`fleet show {row['task_id']}` has its runs and journal; `fleet resume {row['task_id']}` or "
              f"`fleet retry {row['task_id']}` sends it back."]
    return "\n".join(lines)


def pull_request_body(row: dict[str, Any], number: int) -> str:
    return (f"Fixes #{number}\n\nOpened by lanefleet for task `{row['key']}` (lane {row['task_lane']}). "
            "Its checks decide: a failure goes back to the agent with the failing checks' logs.")
