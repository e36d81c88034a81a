"""``uapplaced``: the service.

``main`` is the entry point (arguments, bus name, signals, exit codes), ``wiring``
the one assembly place (every collaborator built in order, closed in reverse),
``service`` the thin D-Bus interface (dbus/org.uap.Placement1.xml), ``authz`` polkit
and same-uid checks, ``notify`` desktop notifications.

May import: every package below it. Nothing imports the daemon.
"""
