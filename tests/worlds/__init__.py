"""Helpers any tier may use, so that no tier imports another's tests.

One module a concern: the documents worlds are seeded with (``seed_docs``, ``registries``),
core model builders (``builders``), the bus's JSON forms (``bus_forms``), the apply steps
(``steps``), waiting on what nothing signals (``polling``), the programs the tests start
(``commands``, ``gate_proxy``), the contained manager's fixtures (``contained``), the peer
socket's path and listener (``peer_socket``), and the machine with real llama.cpp engines
(``llama``: the engines tier's world; it starts ``uapplaced`` and the shim with the bus
tier's launchers, as the systemd tier's live world does).
"""
