"""The kill matrix in the suite (``tests/kill_matrix.py``): writers, single senders from
threads, scheduled and TTL senders, an exclusive consumer, a shared consumer's pool, cleanup
and compaction, a sender and a consumer of an address whose retention removes unread rows,
each a child forked from this process, SIGKILLed at random moments (each kill proven) and
restarted; the whole history audited every 50 kills and at the end, with ``durablequeue
verify`` on every address.

Sized for CI: ``DQ_KILL_MATRIX_KILLS`` kills (default 100: 25-30 s on the 2-core machine at a
load average of 2-4, 46-70 s at 9-16); ``make crash-matrix`` runs 10,000. ``DQ_CRASH_SEED``
repeats a run's choices.
"""

from __future__ import annotations

import os

import pytest
from crash_runs import crash_seed
from kill_matrix import run

pytestmark = pytest.mark.crash

KILLS = int(os.environ.get("DQ_KILL_MATRIX_KILLS", 100))


def test_every_history_survives_a_hundred_sigkills_of_every_role(tmp_path):
    seed, _ = crash_seed()
    figures = run(KILLS, seed, tmp_path, check_every=50)
    assert figures["kills"] >= KILLS and figures["audits"] >= 2, figures
    # the scenario happened: rows flowed, were dead-lettered and expired, and kills landed
    # between a step's intent line and its end (inside sends, acks, nacks)
    assert figures["messages"] > 100 and figures["dead_letters"] and figures["expired"], \
        f"{figures} (seed {seed})"
    assert figures["mid_step_kills"] >= KILLS // 10, f"{figures} (seed {seed})"
    # retention removed rows its consumer had not read (the audit accepted them as lost)
    assert figures["retention_unread"], f"{figures} (seed {seed})"
