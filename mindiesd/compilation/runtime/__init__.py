"""How a fused graph runs: :mod:`.lowering` lowers it once into a program; :mod:`.executor` runs that program
from C++ and :mod:`.python_runner` as generated Python; :mod:`.device_graph` captures and replays it on an
accelerator; :mod:`.kernel_choice` measures, per fused site, which implementation runs."""
