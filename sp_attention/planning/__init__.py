"""The planning floor: what runs where, as pure functions of sizes, ranks and boundaries.

No process group, no collective, no kernel: everything here maps integers (and a packed row's
boundaries) to plans, the same on every rank, so it is unit-tested for any P without spawning
processes. Both the ops (:mod:`sp_attention.linear`, :mod:`sp_attention.softmax`) and the cost
model (:mod:`sp_attention.cost`) plan with it; it imports neither (the floors are drawn in
``sp_attention/README.md``).

Modules, one job each:

* :mod:`.layout`: the sequence layouts (names, the default), rank arithmetic, ring
  neighbours, the tree-scan partner schedule.
* :mod:`.schedules`: the one home of the schedule names (linear scans, softmax presets and
  their pairs, the defaults), the linear chunk length and the default head stride.
* :mod:`.packing`: the packing plan of packed documents over a group (:class:`~.packing.
  PackingPlan`, :func:`~.packing.plan_packing`, :func:`~.packing.resolve_plan`).
* :mod:`.linear_packed`: packed linear attention's local sequences and scan elements.
* :mod:`.softmax_plan`: which query piece meets which key piece in the softmax schedules.
* :mod:`.softmax_packed`: packed softmax attention's pairs, calls and travel windows.
"""
