"""Entry point of a follower rank (started by deepfuse.engine.distributed.launch): its
arguments arrive pickled on stdin."""
import pickle
import sys

from deepfuse.engine.distributed import _worker

if __name__ == "__main__":
    _worker(*pickle.load(sys.stdin.buffer))
