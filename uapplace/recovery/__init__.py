"""Start-up repair of a run a crash cut short.

``recover.recover`` reads the journal, ``repair`` holds the table's rows as actions,
``checks`` what the repair observes (unit states, verify, sleep, a router's model
statuses, free memory), ``routed`` the llama.cpp router lever it pulls (unload, load).
The table is in docs/invariants.md ("Crash recovery").

May import: everything below the daemon except ``measure`` and ``consent``.
"""
