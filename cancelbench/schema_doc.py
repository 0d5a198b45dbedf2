"""Renders ``docs/schema.md`` from the record schema in :mod:`cancelbench.schema`.

The column table comes from ``schema.FIELDS`` (name, Arrow type, group, owner, doc), the
clock-domain text from ``schema``'s module docstring, the partition columns
from ``schema.PARTITION_COLUMNS``; nothing in the page is typed by hand twice.
Regenerate after any change to the schema::

    python -m cancelbench.schema_doc > docs/schema.md

``tests/test_docs.py`` fails when the committed page differs from this output.
"""

from __future__ import annotations

import sys

from cancelbench import schema

REGENERATE = "python -m cancelbench.schema_doc > docs/schema.md"

# How a results directory is laid out and read. Kept here, beside the generator,
# so the generated page is whole; the partition path is built from the schema.
_LAYOUT = """\
DIR/manifest.json        schema version, sweep id, config, seeds, versions, agents + clock offsets, status, not_run
DIR/plan.parquet         the whole pre-generated plan
DIR/records/{partition}/part-*.parquet  one file per partition once the sweep ended (compacted)
DIR/audio/*.wav          TTS reference runs (listen to what was synthesized)
DIR/report.txt           the terminal report, written at the end of the sweep (= cancelbench report DIR)
DIR/report.html          the HTML report with its plots
DIR/unwritten-*.jsonl    only when Parquet refused records: they are kept as JSON lines"""


def _markdown(text: str) -> str:
    """The reST of a docstring as Markdown: ``x`` -> `x`, underlined titles -> ## headings."""
    lines = text.replace("``", "`").splitlines()
    out: list[str] = []
    for line in lines:
        if out and line and set(line.strip()) <= {"-", "="} and len(line.strip()) >= 3 and out[-1].strip():
            out[-1] = "## " + out[-1].strip()
            out.append("")
            continue
        out.append(line.rstrip())
    return "\n".join(out).strip()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _fields() -> list[tuple[str, str, str, str, str]]:
    """(column, type, group, filled by, doc) of every column, in record order."""
    return [(c.name, str(c.type), c.group, c.owner, c.doc) for c in schema.FIELDS]


def _cpu_body() -> str:
    """cancelbench/schema_cpu.py's docstring below its first paragraph (the split, its sources, its limits)."""
    from cancelbench import schema_cpu

    return (schema_cpu.__doc__ or "").strip().split("\n\n", 1)[1]


def schema_markdown() -> str:
    """The whole of docs/schema.md."""
    doc = (schema.__doc__ or "").strip()
    summary, _, body = doc.partition("\n")
    partition = "/".join(f"{c}=<{c}>" for c in schema.PARTITION_COLUMNS)
    parts = [
        "# Records",
        f"<!-- GENERATED from cancelbench/schema.py by `{REGENERATE}`; do not edit by hand. -->",
        f"Generated from `cancelbench/schema.py`; regenerate with `{REGENERATE}` "
        "(`tests/test_docs.py` fails when this page and the schema disagree).",
        f"{_markdown(summary)} Schema version **{schema.SCHEMA_VERSION}** "
        "(stored in every row and in the Parquet schema metadata `cancelbench_schema_version`).",
        "## Dataset layout",
        "```\n" + _LAYOUT.format(partition=partition) + "\n```",
        "Readable by pandas (`cancelbench.sink.read_records(DIR)`), pyarrow "
        "(`pyarrow.dataset.dataset(\"DIR/records\", partitioning=\"hive\")`) and DuckDB "
        "(`read_parquet('DIR/records/**/*.parquet', hive_partitioning=true)`).",
        "**Compaction.** The sweep writes a small file per flush and, at its end (complete, interrupted or "
        "resumed), rewrites each partition's files into one, `part-*-compacted.parquet`, whose Parquet footer "
        "(`cancelbench_compacted_from`) names the files it replaces. Those are *superseded* as soon as it "
        "appears (one rename) and are deleted next. cancelbench's readers (`read_records`, `open_dataset`, "
        "`report`) skip superseded files, so they see each record once at every instant, even after a driver "
        "killed mid-compaction; `--resume` deletes what such a driver left. A plain glob (pyarrow on the "
        "directory, DuckDB) knows no such rule: use it on a dataset no sweep is writing, and not after a "
        "killed sweep until `--resume` ran.",
        "**Partition columns**: " + ", ".join(f"`{c}`" for c in schema.PARTITION_COLUMNS)
        + ". They live in the directory names, not inside the Parquet files; their values are sanitized "
        "to `[A-Za-z0-9._-]` (`hostname` keeps the raw host name).",
        _markdown(body),
        _markdown(_cpu_body()),
        "## Columns",
        "Every column belongs to one group; `diff` compares two cells only when their `settings` columns "
        "agree. *Filled by*: the driver, the agent, either, or derived from the timestamps.",
        "| column | type | group | filled by | meaning |\n|---|---|---|---|---|\n" + "\n".join(
            f"| `{name}` | {typ} | {group} | {owner} | {_cell(doc)} |" for name, typ, group, owner, doc in _fields()),
    ]
    return "\n\n".join(p for p in parts if p) + "\n"


def main() -> int:
    sys.stdout.write(schema_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
