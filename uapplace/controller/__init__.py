"""The controller: all live state, written only by itself.

``controller.Controller`` owns the admission table, residents, holds, usage clocks,
cooldowns and alerts; the other modules are its parts: the configuration in force
(``configstate``, which also makes residents follow a re-measure), pending entries'
options (``pending``), the ledger's write-behind (``persist``), holds (``holds``), usage
and cooldowns (``standing``), what follows an alert (``alertdesk``), the host against its
reserve (``reserve``), a GPU's memory against its residents' footprints (``drift``), the
``Conflicts=`` drop-ins (``dropins``), its JSON views
(``views``), the Protocols of its collaborators (``ports``), the door to
enforcement (``door``), residents listed on another device than measured (``misfiled``)
and ``validate``'s findings from what the units run now (``launchcheck``).

May import: ``core``, ``files``, ``bus``, ``io``. It knows no machinery: enforcement,
recovery and publication call it, never the other way round.

Why 17 modules: the controller is one object and the single writer of the live state
(docs/architecture.md, "State: who writes what"); each module is one facet of that state or
one collaborator's Protocol, and none of them is used without the controller. Splitting
them into sub-packages would put the one writer's parts on two floors.
"""
