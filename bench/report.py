"""Write one benchmark table three ways: JSON (everything), markdown (the table), PNG (TPOT vs floor).

Rewritten after every row, so a call cut short still returns what it measured. Each file carries
the command that made it.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

COLUMNS = ("row", "budget", "TPOT ms (median / p90)", "TTFT ms", "hit rate", "PCIe GB/token",
           "PCIe wait ms/token", "acceptance", "floor ms (bound)", "measured/floor", "notes")


def _num(value: float | None, fmt: str) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def _notes(row: dict) -> str:
    extra = row["extra"]
    if "error" in extra:
        return f"ERROR: {extra['error'][:160]}"
    if "skipped" in extra:
        return f"skipped: {extra['skipped']}"
    notes = [f"{extra.get('prompts_timed', 0)} prompts x {row['tokens'] // max(1, extra.get('prompts_timed', 1))} tokens"]
    notes += [extra["note"]] if "note" in extra else []
    return "; ".join(notes)


def _markdown_row(row: dict) -> str:
    extra, floor = row["extra"], row["extra"].get("floor", {})
    wait = extra.get("pcie_wait_s_per_token")
    cells = (
        row["name"], extra.get("budget", "all"),
        f"{_num(row['tpot_median_s'] * 1e3, '.2f')} / {_num(row['tpot_p90_s'] * 1e3, '.2f')}",
        _num(row["ttft_median_s"] * 1e3, ".1f"), _num(extra.get("hit_rate"), ".1%"),
        _num(extra.get("pcie_gb_per_token"), ".3f"), _num(None if wait is None else wait * 1e3, ".2f"),
        _num(extra.get("acceptance_rate"), ".1%"),
        f"{_num(floor.get('floor_s', math.nan) * 1e3, '.3f')} ({floor.get('bound', '–')})",
        _num(extra.get("measured_over_floor"), ".1f"), _notes(row),
    )
    return "| " + " | ".join(cells) + " |"


def markdown(result: dict) -> str:
    lines = [f"# {result['title']}", "", f"Command: `{result['command']}`", "",
             f"Device: {result.get('device', '?')}; {result.get('versions', '')}", ""]
    lines += [f"- {note}" for note in result.get("notes", [])] + [""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += [_markdown_row(row) for row in result["rows"]]
    if result.get("ratios"):
        lines += ["", "Ratios:", ""] + [f"- {k}: {_num(v, '.2f') if isinstance(v, float) else v}" for k, v in result["ratios"].items()]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if not math.isnan(r["tpot_median_s"])]
    if not rows:
        return
    labels = [f"{r['name']} [{r['extra'].get('budget', 'all')}]" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    y = range(len(rows))
    ax.barh(y, [r["tpot_median_s"] * 1e3 for r in rows], color="tab:blue", label="TPOT median")
    floors = [r["extra"].get("floor", {}).get("floor_s", math.nan) * 1e3 for r in rows]
    ax.scatter(floors, y, marker="|", s=300, color="black", label="floor", zorder=3)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ms per output token (log scale)")
    ax.set_title(result["title"], fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.text(0.01, 0.005, result["command"][:160], fontsize=6)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(out_dir: Path, stem: str, result: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    (out_dir / f"{stem}.md").write_text(markdown(result))
    plot(result, out_dir / f"{stem}.png")
