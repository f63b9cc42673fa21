"""``--tensor-parallel-size`` and ``--expert-parallel`` for the commands that load a model (generate, chat,
serve, bench): the options, and the keyword arguments of ``model.load`` they mean."""
from __future__ import annotations

import argparse
from typing import Any


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="split the model over N devices from --device on (cuda: N GPUs; cpu: N processes); exl3 "
                        "starts the other ranks itself. Default: one device, no split")
    p.add_argument("--expert-parallel", action="store_true",
                   help="with --tensor-parallel-size: divide each mixture-of-experts layer's experts among the "
                        "ranks instead of splitting every expert")


def parallel_load_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``model.load`` arguments of the options (none when neither is given).

    :raises ValueError: for a size below 1, or --expert-parallel without a size."""
    size = getattr(args, "tensor_parallel_size", None)
    ep = bool(getattr(args, "expert_parallel", False))
    if size is None:
        if ep:
            raise ValueError("--expert-parallel needs --tensor-parallel-size N (the ranks the experts divide over)")
        return {}
    if size < 1:
        raise ValueError(f"--tensor-parallel-size {size}: must be at least 1")
    return {"tensor_parallel_size": size, "expert_parallel": ep}
