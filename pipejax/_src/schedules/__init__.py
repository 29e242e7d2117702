"""The schedules: static tables of which device runs which (micro-batch, stage) slot at which tick
(:mod:`~pipejax._src.schedules.tables`), and any table drawn as a timeline
(:mod:`~pipejax._src.schedules.timeline`)."""
