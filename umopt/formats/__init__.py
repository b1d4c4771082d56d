"""The files umopt reads and writes: profiles (what each stage costs, :mod:`.profile`), schedules
(who runs which chunk when, :mod:`.schedule`) and run reports (:mod:`.report`). docs/formats.md is
their contract. The modules are imported by name (a profile is read before the cost model exists,
a schedule is checked with it), so this package imports none of them."""
