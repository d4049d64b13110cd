"""The benches of mindiesd (``mindiesd bench``): tooling apart from the product, which never imports it.

``cli`` builds the ``bench`` command on top of the modes ``models``, ``ops``, ``pipeline`` and ``distributed``;
they stand on ``common``, ``table``, ``timing`` and ``environment`` (also behind ``python -m mindiesd env``).
Imports go down only.
"""
