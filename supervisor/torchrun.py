"""`python -m supervisor.torchrun ARGS`: torchrun (`torch.distributed.run`), handed only the options the
installed torch's torchrun defines (supervisor/torchcompat.py drops the tuning options it lacks).

Every attempt's torchrun runs through `main`, however it starts: as this module (a cold launch), from a
zygote, or forked by the prewarm server.
"""

from __future__ import annotations

import sys


def main(args: list[str]) -> None:
    import torch.distributed.run as torchrun

    from supervisor.torchcompat import torchrun_args

    torchrun.main(torchrun_args(args, torchrun.get_args_parser()))


if __name__ == "__main__":
    main(sys.argv[1:])
