"""``lowbit train`` under torchrun, with a hostile rank 1 (tests/test_liveness.py).

    torchrun ... tests/torchrun_hostile_result.py MARKER -- <lowbit train options>

Rank 1 trains as usual, then hands back, instead of its result, an object whose
``__reduce__`` would write MARKER wherever it is unpickled; and what it sends
on the wire is that object's pickle. Whatever rank 0 does with it, MARKER must
never appear.
"""

import os
import pickle
import sys


class Hostile:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        code = f"open({self.marker!r}, 'w').write('code ran in RANK=' + __import__('os').environ['RANK'])"
        return (eval, (code,))


if __name__ == "__main__":
    marker, argv = sys.argv[1], sys.argv[3:]
    if os.environ["RANK"] == "1":
        import lowbit.comm.wire_objects as wire_objects
        import lowbit.train.run as run

        honest = run.run_worker
        run.run_worker = lambda *a, **k: (honest(*a, **k), Hostile(marker))[1]  # what a pickling collector sends
        wire_objects.dumps = lambda value: pickle.dumps(value)  # and its bytes in place of lowbit's frame

    from lowbit.cli import main

    sys.exit(main(argv))
