"""Plot train.py runs side by side (e.g. CP attention against the local-only baseline)::

    python -m sp_train.plot runs/cp/log.jsonl "CP attention" \\
        runs/local/log.jsonl "local attention only" -o docs/copy_task.png --chance 3.466
"""
from __future__ import annotations

import argparse

from .progress import plot_losses, read_log


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pairs", nargs="+", help="LOG.jsonl LABEL [LOG.jsonl LABEL ...]")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--chance", type=float, default=None, help="draw the chance loss line")
    p.add_argument("--title", default="copy task: loss on the copied tokens")
    a = p.parse_args(argv)
    if len(a.pairs) % 2:
        p.error("give LOG LABEL pairs")
    curves = {a.pairs[i + 1]: read_log(a.pairs[i]) for i in range(0, len(a.pairs), 2)}
    print(plot_losses(curves, a.output, chance=a.chance, title=a.title))


if __name__ == "__main__":
    main()
