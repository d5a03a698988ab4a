"""resilient's supervisor: the CLI and the library behind `resilient run`, `status`, `inspect-checkpoint`
and `gc`.

Nothing in this package imports torch at import time: the light commands must answer in a fraction of a
second on a busy login node.
"""

__version__ = "0.1.0"
