"""Where a compiled graph is kept: :mod:`.cache` (the persistent cache: keys, entries, loading), the format a
graph is stored in (:mod:`.stored_graph`) and the symbolic sizes a stored graph is keyed and guarded by
(:mod:`.symbolic_sizes`)."""
