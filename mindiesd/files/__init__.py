"""Files on disk: which of them may be loaded.

:mod:`.trust` decides whether a cache file or a built module may be opened (owner, permissions, no symbolic
link below the root) and opens them without following links. It is the package's bottom floor: the graph cache
(``compilation/storage``) and the kernels' build (``ops/kernels/cpp_build.py``) use it, and it imports nothing of
mindiesd.
"""
