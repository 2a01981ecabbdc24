"""Take a new snapshot of the course's prose as the lessons' training text: src/zero_offload/data/corpus.txt.

    python tools/make_corpus.py

Every lesson's printed losses and traces change with a new snapshot: re-execute them (`make lessons`) and update
the numbers the chapters quote.
"""

from __future__ import annotations

from pathlib import Path

from zero_offload.workloads import CORPUS_SNAPSHOT, course_prose

REPO = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    CORPUS_SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
    CORPUS_SNAPSHOT.write_bytes(course_prose(REPO))
    print(f"wrote {CORPUS_SNAPSHOT} ({CORPUS_SNAPSHOT.stat().st_size:,} bytes)")
